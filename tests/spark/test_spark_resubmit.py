"""A routed Spark job whose driver process group is SIGKILLed, re-submitted after the stream's
duplicate window, stores every row once, each key in order (issue 17 item 2): it resumes
from locations import TESTS
from what the stream holds, as the core's publish_run does, not from the ledger (which a
killed driver never wrote)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from locations import TESTS
from spark_helpers import WINDOW, exactly_once_in_order, on_server, run_record, stored

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

pytest.importorskip("pyspark")

APP = TESTS / "spark_resubmit_app.py"
ROWS = 4000


def _submit(url: str, stream: str, log: Path, *extra: str) -> subprocess.Popen:
    venv_bin = Path(sys.executable).parent
    env = dict(os.environ)
    env.update(PYSPARK_PYTHON=sys.executable, PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}")
    cmd = [
        str(venv_bin / "spark-submit"),
        "--master",
        "local[2]",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.speculation=false",
        str(APP),
        url,
        stream,
        "killed",
        str(ROWS),
        *extra,
    ]
    with log.open("w") as out:  # Spark logs much to stderr: a pipe could fill and block it
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@pytest.mark.slow
def test_a_killed_spark_submit_resubmitted_after_the_window_stores_every_row_once(
    nats_url, unique_name, tmp_path
):
    spec = StreamSpec(unique_name, partitions=4, duplicate_window=WINDOW)
    on_server(nats_url, lambda nc: provision(nc, spec))

    async def count(nc) -> int:
        return (await nc.jetstream().stream_info(unique_name)).state.messages

    first = _submit(nats_url, unique_name, tmp_path / "first.log", "--slow")
    try:
        deadline = time.monotonic() + 240
        at_kill = 0
        while time.monotonic() < deadline and first.poll() is None:
            at_kill = on_server(nats_url, count)
            if at_kill >= 200:
                break
            time.sleep(0.05)
        log = (tmp_path / "first.log").read_text()[-3000:]
        assert first.poll() is None, f"the job ended before it was killed ({at_kill}): {log}"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    killed = run_record(nats_url, unique_name, "killed")
    assert killed is not None and killed.status == "running" and not killed.acked_per_partition
    stored_at_kill = len(stored(nats_url, unique_name))
    assert 0 < stored_at_kill < ROWS, stored_at_kill

    async def stored_at(nc, seq: int) -> dt.datetime:
        return (await nc.jetstream().get_msg(unique_name, seq)).time

    last_at_kill = on_server(nats_url, lambda nc: stored_at(nc, stored_at_kill))
    # the second job waits past the window itself, before it writes: its JVM starts meanwhile
    second = _submit(nats_url, unique_name, tmp_path / "second.log", "--after-window")
    second.wait(300)
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-3000:]
    first_resent = on_server(nats_url, lambda nc: stored_at(nc, stored_at_kill + 1))
    assert first_resent - last_at_kill > dt.timedelta(seconds=WINDOW), (
        "the re-submit wrote inside the duplicate window: a resend would not show"
    )

    rows = [{"k": f"key-{i % 50}", "ts": 1_000 + i, "i": i, "pad": "x" * 200} for i in range(ROWS)]
    problems = exactly_once_in_order(rows, stored(nats_url, unique_name), "k", "ts")
    assert problems == [], f"{stored_at_kill} rows were stored at the kill: {problems}"
    rec = run_record(nats_url, unique_name, "killed")
    assert rec is not None and rec.status == "complete" and rec.acked == ROWS
    assert rec.skipped == stored_at_kill and rec.attempts == 2, rec.to_dict()
