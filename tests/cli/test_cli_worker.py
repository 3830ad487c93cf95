"""`nats-ordered worker` and `nats-ordered status` as users run them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from locations import TESTS
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli


def _status(url, stream, capsys, starting=False):
    code = cli(["status", "--stream", stream, "--group", "g", "--json", "--server", url])
    out = capsys.readouterr()
    if starting and code == 2 and "has no state yet" in out.err:
        return None  # the worker has not created the group's buckets yet
    assert code == 0, out.err
    return json.loads(out.out)


def test_worker_drains_the_stream_status_reports_it_and_sigterm_exits_0(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, ({"k": f"k{i % 7}", "i": i} for i in range(700)))
    assert cli(["provision", "--stream", unique_name, "--partitions", "4", "--server", url]) == 0
    assert (
        cli(["publish", "--stream", unique_name, str(rows), "--key-field", "k", "--server", url])
        == 0
    )
    capsys.readouterr()
    env = dict(os.environ, PYTHONPATH=str(TESTS), CHAOS_SINK=str(tmp_path / "sink.db"))
    import sqlite3

    from chaos_handlers import EVENTS_DDL

    from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink

    FencedSqliteSink(tmp_path / "sink.db", stream=unique_name, group="g").close()
    with sqlite3.connect(tmp_path / "sink.db") as db:
        db.execute(EVENTS_DDL)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "airflow_nats_ordered.cli",
            "worker",
            "--stream",
            unique_name,
            "--group",
            "g",
            "--handler",
            "chaos_handlers:Recorder",
            "--member-id",
            "solo",
            "--lease-ttl",
            "2",
            "--server",
            url,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a bound on a hang: a loaded machine is slow
        while True:
            st = _status(url, unique_name, capsys, starting=True)
            if (
                st
                and st["partitions"]
                and sum(p["lag"] for p in st["partitions"]) == 0
                and all(p["owner"] == "solo" for p in st["partitions"])
            ):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.3)
        assert st["generation"] >= 1 and st["leader"] == "solo"
        assert [m["member"] for m in st["members"]] == ["solo"]
        assert st["members"][0]["partitions"] == [0, 1, 2, 3]
        for p in st["partitions"]:
            assert set(p) >= {"partition", "owner", "fencing_token", "committed", "last", "lag"}
            assert p["committed"] == p["last"] and p["fencing_token"] >= 1
        # the readable table
        assert cli(["status", "--stream", unique_name, "--group", "g", "--server", url]) == 0
        table = capsys.readouterr().out
        assert "partition" in table and "heartbeat age" in table and "leader solo" in table
        # a member can be inspected in place: threads (SIGUSR1) and asyncio tasks (SIGUSR2)
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Current thread" in err or "Thread 0x" in err  # faulthandler's dump
    assert "asyncio tasks ---" in err and "_heartbeat_loop" in err
    assert "700 messages processed" in err
    after = _status(url, unique_name, capsys)
    assert all(p["owner"] is None for p in after["partitions"])  # released, not expired
    assert after["members"] == []


def test_a_second_sigterm_exits_at_once_even_if_the_handler_close_hangs(
    shared_nats_server, unique_name
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "worker", "--stream", unique_name]
        + ["--group", "g", "--handler", "chaos_handlers:StuckClose", "--lease-ttl", "2"]
        + ["--server", url],
        env=dict(os.environ, PYTHONPATH=str(TESTS)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert "joined group g" in line, line
        proc.send_signal(signal.SIGTERM)
        assert "close() is stuck" in proc.stdout.readline()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)  # close() is stuck for 120 s: exiting before shows it was not awaited
        assert time.monotonic() - t0 < 60
    finally:
        proc.kill()
        proc.communicate()
    assert code == 143  # 128 + SIGTERM, as a shell reports it


def test_status_of_an_unknown_group_says_how_to_start_one(shared_nats_server, unique_name, capsys):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    code = cli(["status", "--stream", unique_name, "--group", "nobody", "--server", url])
    assert code == 2
    assert "nats-ordered worker --stream" in capsys.readouterr().err


@pytest.mark.parametrize(
    "handler,match",
    [
        ("nodots", "package.module:function"),
        ("no_such_mod:f", "cannot import handler module"),
        ("chaos_handlers:Nope", "has no attribute"),
    ],
)
def test_bad_handler_paths_are_clear_errors(
    shared_nats_server, unique_name, capsys, monkeypatch, handler, match
):
    monkeypatch.syspath_prepend(str(TESTS))
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    code = cli(
        ["worker", "--stream", unique_name, "--group", "g", "--handler", handler, "--server", url]
    )
    assert code == 2 and match in capsys.readouterr().err


def test_a_worker_that_stops_on_an_error_exits_3_not_the_usage_code(
    shared_nats_server, unique_name
):
    """A runtime failure has its own exit code: 2 means "fix the command line"."""
    import asyncio

    import nats

    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "worker", "--stream", unique_name]
        + ["--group", "g", "--handler", "chaos_handlers:ignore", "--lease-ttl", "2"]
        + ["--server", url],
        env=dict(os.environ, PYTHONPATH=str(TESTS)),
        stderr=subprocess.PIPE,
        text=True,
    )

    async def corrupt_the_assignment():
        nc = await nats.connect(url)
        kv = await nc.jetstream().key_value(f"nor_{unique_name}_g_state")
        await kv.put("assignment", b"not an assignment")
        await nc.close()

    try:
        assert "joined group g" in proc.stderr.readline()
        asyncio.run(corrupt_the_assignment())  # the member's loops cannot go on
        code = proc.wait(30)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert code == 3, err
    assert "stopped on an error" in err and "Fix the cause and start it again" in err


def test_help_lists_every_exit_code(capsys):
    assert cli(["--help"]) == 0
    top = capsys.readouterr().out
    assert cli(["worker", "--help"]) == 0
    worker = capsys.readouterr().out
    for text in (top, worker):
        assert "exit codes:" in text
        for code in ("  0 ", "  1 ", "  2 ", "  3 ", "  130 ", "143 by SIGTERM"):
            assert code in text, code
    assert "left gracefully on SIGTERM/SIGINT exits 0" in top
    assert "exit 0 (a graceful leave is a success); a second signal exits at once with 143" in (
        " ".join(worker.split())
    )


def test_worker_and_publish_flags_reach_their_config_fields():
    from airflow_nats_ordered.cli import build_parser
    from airflow_nats_ordered.cli.publish import _publisher_knobs
    from airflow_nats_ordered.cli.worker import _worker_config

    parser = build_parser()
    base = ["worker", "--stream", "S", "--group", "g", "--handler", "m:f"]
    cfg = _worker_config(parser.parse_args(base))
    assert (cfg.max_buffer_bytes, cfg.state_replicas, cfg.missing_commit) == (
        64 * 1024**2,
        None,
        "fail",
    )  # the WorkerConfig defaults when the flags are left out
    args = parser.parse_args(
        [*base, "--max-buffer-bytes", "8MiB", "--state-replicas", "3"]
        + ["--missing-commit", "earliest"]
    )
    cfg = _worker_config(args)
    assert (cfg.max_buffer_bytes, cfg.state_replicas, cfg.missing_commit) == (
        8 * 1024**2,
        3,
        "earliest",
    )
    pub = ["publish", "--stream", "S", "-", "--key-field", "k"]
    knobs = _publisher_knobs(parser.parse_args([*pub, "--max-pending-bytes", "1MiB"]))
    assert knobs["max_pending_bytes"] == 1024**2
    assert "max_pending_bytes" not in _publisher_knobs(parser.parse_args(pub))
    for bad in (["--max-buffer-bytes", "unlimited"], ["--missing-commit", "never"]):
        try:
            parser.parse_args([*base, *bad])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
