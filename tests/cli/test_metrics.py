"""`--metrics-port`: Prometheus metrics and the health endpoint of a real worker process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from locations import TESTS
from metrics_scrape import get, sample, scrape, wait_for
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.embedded.process import free_port


def provision_and_publish(url: str, stream: str, tmp_path: Path, n: int, partitions: int) -> None:
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, ({"k": f"k{i % 11}", "i": i} for i in range(n)))
    args = ["--stream", stream, "--server", url]
    assert cli(["provision", *args, "--partitions", str(partitions)]) == 0
    assert cli(["publish", *args, str(rows), "--key-field", "k"]) == 0


def test_worker_metrics_report_partitions_and_counters_and_health_turns_503_when_nats_pauses(
    nats_server, unique_name, tmp_path, capsys
):
    url = nats_server.url
    provision_and_publish(url, unique_name, tmp_path, 200, 4)
    capsys.readouterr()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "worker", "--stream", unique_name]
        + ["--group", "g", "--handler", "chaos_handlers:ignore", "--member-id", "m1"]
        + ["--lease-ttl", "2", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"]
        + ["--server", url],
        env=dict(os.environ, PYTHONPATH=str(TESTS)),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "joined group g" in proc.stderr.readline()

        def drained():
            s = scrape(port)
            # (a scrape reads the member's counters before the group view: both must be done)
            done = sample(s, "nats_ordered_member_processed_total", member="m1") == 200
            return s if done and sample(s, "nats_ordered_group_lag", group="g") == 0 else None

        s = wait_for(drained, 30, "the group to drain")
        assert sample(s, "nats_ordered_member_processed_total", member="m1") == 200
        assert sample(s, "nats_ordered_member_dead_lettered_total", member="m1") == 0
        assert sample(s, "nats_ordered_member_leases_lost_total", member="m1") == 0
        assert sample(s, "nats_ordered_member_owned_partitions", member="m1") == 4
        assert sample(s, "nats_ordered_member_healthy", member="m1") == 1
        assert sample(s, "nats_ordered_group_members", group="g") == 1
        lasts = 0
        for p in map(str, range(4)):
            committed = sample(s, "nats_ordered_partition_committed", partition=p)
            last = sample(s, "nats_ordered_partition_last", partition=p)
            assert committed == last and last > 0
            assert sample(s, "nats_ordered_partition_lag", partition=p) == 0
            assert sample(s, "nats_ordered_partition_owner", partition=p, owner="m1") == 1
            lasts = max(lasts, last)
        assert lasts == 200  # the last partition to get a message holds the stream's last seq
        status, body = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200 and json.loads(body)["healthy"] is True, body
        assert json.loads(body)["partitions"] == [0, 1, 2, 3]

        # the server stops answering: the member cannot renew, and says so within ~TTL
        nats_server.pause()
        try:
            t0 = time.monotonic()

            def unhealthy():
                status, body = get(f"http://127.0.0.1:{port}/healthz")
                return (status, json.loads(body)) if status == 503 else None

            status, health = wait_for(unhealthy, 10, "/healthz to turn 503")
            went_503_after = time.monotonic() - t0
            assert health["healthy"] is False
            # first the leases in hand pass their deadline; then the missing round trips tell
            # it even for a member that owns nothing
            reasons = ("expired without a renewal", "leases cannot be renewed")
            assert all(any(r in p for r in reasons) for p in health["problems"]), health

            def no_roundtrip():
                _, body = get(f"http://127.0.0.1:{port}/healthz")
                problems = json.loads(body)["problems"]
                return any("leases cannot be renewed" in p for p in problems)

            wait_for(no_roundtrip, 5, "the missing round trips to show")
            # metrics are still served (the group view is not: it needs NATS)
            s = scrape(port)
            assert sample(s, "nats_ordered_member_healthy", member="m1") == 0
            assert sample(s, "nats_ordered_group_view_ok", member="m1") == 0
        finally:
            nats_server.resume()
        wait_for(lambda: get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 15, "health to recover")
        print(f"/healthz went 503 {went_503_after:.1f}s after the server paused (TTL 2s)")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert went_503_after < 2 + 1 + 1.5  # TTL + probe interval + scrape slack


def test_metrics_port_in_use_is_a_usage_error_naming_the_flag(
    shared_nats_server, unique_name, capsys
):
    import socket

    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        capsys.readouterr()
        code = cli(
            ["worker", "--stream", unique_name, "--group", "g", "--server", url]
            + ["--handler", "json:dumps"]
            + ["--metrics-port", str(port), "--metrics-addr", "127.0.0.1"]
        )
    assert code == 2
    assert f"--metrics-port {port}: cannot listen" in capsys.readouterr().err
