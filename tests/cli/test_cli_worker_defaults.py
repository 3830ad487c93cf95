"""`nats-ordered worker` and `pool` start members with WorkerConfig's own defaults: the
commit cadence moved to 25 messages / 0.1 s (commits written in the background), and the
CLI kept 1000 / 1 s, so a CLI worker re-delivered ~40x more after a SIGKILL than the same
member started from Python."""

from __future__ import annotations

import pytest

from airflow_nats_ordered.cli import build_parser
from airflow_nats_ordered.core.worker.config import WorkerConfig


@pytest.mark.parametrize("command", [["worker"], ["pool", "--size", "2"]], ids=["worker", "pool"])
def test_member_flags_default_to_the_worker_configs_defaults(command):
    flags = ["--stream", "S", "--group", "g", "--handler", "m:f"]
    args = build_parser().parse_args([*command, *flags])
    want = WorkerConfig("S", "g")
    assert (args.commit_every, args.commit_interval) == (want.commit_every, want.commit_interval)
    assert args.fetch_batch == want.fetch_batch and args.max_retries == want.max_retries
