"""`nats-ordered pool`: real member processes supervised by a real pool process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from chaos_handlers import EVENTS_DDL
from locations import TESTS
from metrics_scrape import free_ports_in_a_row, get, sample, scrape, wait_for
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import build_parser
from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.cli.pool import Supervisor, member_argv
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink


class Lines:
    """A process's stderr, collected by a thread (so the pipe never fills)."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def pid_of(self, member: str) -> int | None:
        pids = re.findall(rf"pool: member {member} started \(pid (\d+)\)", self.text())
        return int(pids[-1]) if pids else None


def _status(url: str, stream: str, capsys):
    code = cli(["status", "--stream", stream, "--group", "g", "--json", "--server", url])
    out = capsys.readouterr()
    if code == 2 and "has no state yet" in out.err:
        return None
    assert code == 0, out.err
    return json.loads(out.out)


def _publish(url: str, stream: str, path: Path, rows, capsys) -> None:
    write_jsonl(path, rows)
    args = ["publish", "--stream", stream, str(path), "--key-field", "k", "--server", url]
    assert cli(args) == 0
    capsys.readouterr()


@pytest.mark.timeout(600)  # generous waits for process start-up on a loaded machine
def test_pool_restarts_a_killed_member_and_everything_is_applied_once_in_key_order(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "6", "--server", url]) == 0
    _publish(
        url,
        unique_name,
        tmp_path / "a.jsonl",
        ({"k": f"k{i % 13}", "i": i} for i in range(600)),
        capsys,
    )
    sink = tmp_path / "sink.db"
    FencedSqliteSink(sink, stream=unique_name, group="g").close()
    with sqlite3.connect(sink) as db:
        db.execute(EVENTS_DDL)
    capsys.readouterr()
    port = free_ports_in_a_row(1 + 3)  # the pool's and its 3 members'
    env = dict(os.environ, PYTHONPATH=str(TESTS), CHAOS_SINK=str(sink), CHAOS_DELAY="0.03")
    pool = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "pool", "--size", "3"]
        + ["--member-prefix", "p", "--stream", unique_name, "--group", "g"]
        + ["--handler", "chaos_handlers:Recorder", "--lease-ttl", "2"]
        + ["--restart-backoff", "0.5", "--metrics-port", str(port)]
        + ["--metrics-addr", "127.0.0.1", "--server", url],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = Lines(pool.stderr)
    try:
        # mid-stream (~3 s of work): the members are processing when one is SIGKILLed; and
        # a second batch arrives while it is down
        seen: list = [None]

        def processing():
            st = seen[0] = _status(url, unique_name, capsys)
            return st if st and len(st["members"]) == 3 and st["total_lag"] < 600 else None

        # three member processes start, import and join: on a loaded 2-core machine that
        # has taken over 60 s (a loaded CI run); what was seen is in the failure
        try:
            wait_for(processing, 180, "three members processing")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; last status: {json.dumps(seen[0])[:1500]}; pool: {log.text()[-3000:]}"
            ) from None
        victim = log.pid_of("p-2")
        os.kill(victim, signal.SIGKILL)
        _publish(
            url,
            unique_name,
            tmp_path / "b.jsonl",
            ({"k": f"k{i % 13}", "i": i} for i in range(600, 1200)),
            capsys,
        )

        def recovered():
            st = _status(url, unique_name, capsys)
            restarted = (log.pid_of("p-2") or victim) != victim
            done = st and st["drained"] and len(st["members"]) == 3
            return st if done and restarted else None

        st = wait_for(recovered, 90, "the group to drain with the restarted member")
        assert sorted(m["member"] for m in st["members"]) == ["p-1", "p-2", "p-3"]
        assert re.search(
            r"pool: member p-2 exited \(killed by SIGKILL\) after .*; restarting it in 0\.5s "
            r"\(restart 1\)",
            log.text(),
        ), log.text()
        # one endpoint for the pool: its supervisor's figures and every member's, merged
        s = wait_for(
            lambda: (
                lambda s: s if sample(s, "nats_ordered_pool_member_up", member="p-2") else None
            )(scrape(port)),
            20,
            "p-2 to be up",
        )
        assert sample(s, "nats_ordered_pool_member_restarts_total", member="p-2") == 1
        assert sample(s, "nats_ordered_pool_member_restarts_total", member="p-1") == 0
        for m in ("p-1", "p-2", "p-3"):
            assert sample(s, "nats_ordered_member_processed_total", member=m) is not None
        assert sample(s, "nats_ordered_group_lag", group="g") == 0  # once, not once a member
        owners = {
            dict(labels)["owner"]
            for (name, labels), v in s.items()
            if name == "nats_ordered_partition_owner" and v == 1
        }
        assert owners <= {"p-1", "p-2", "p-3"} and len(owners) >= 2
        status, body = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200, body
        assert set(json.loads(body)["members"]) == {"p-1", "p-2", "p-3"}
    finally:
        pool.send_signal(signal.SIGTERM)
        code = pool.wait(60)
    assert code == 0, log.text()
    assert "pool: all 3 members left" in log.text()
    after = _status(url, unique_name, capsys)
    assert after["members"] == [] and all(p["owner"] is None for p in after["partitions"])
    # applied exactly once, and per key in publish order, across the kill and the restart
    with sqlite3.connect(sink) as db:
        rows = db.execute("SELECT k, i FROM events ORDER BY id").fetchall()
    assert sorted(i for _, i in rows) == list(range(1200))
    per_key: dict[str, list[int]] = {}
    for k, i in rows:
        per_key.setdefault(k, []).append(i)
    assert all(v == sorted(v) for v in per_key.values())


def test_sigterm_makes_every_member_leave_and_the_pool_exit_0(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "4", "--server", url]) == 0
    pool = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "pool", "--size", "2"]
        + ["--member-prefix", "q", "--stream", unique_name, "--group", "g"]
        + ["--handler", "chaos_handlers:ignore", "--lease-ttl", "2", "--server", url],
        env=dict(os.environ, PYTHONPATH=str(TESTS)),
        stderr=subprocess.PIPE,
        text=True,
    )
    log = Lines(pool.stderr)
    try:

        def both_own():
            st = _status(url, unique_name, capsys)
            return (
                st
                if st
                and all(p["owner"] for p in st["partitions"])
                and len({p["owner"] for p in st["partitions"]}) == 2
                else None
            )

        wait_for(both_own, 30, "both members to own partitions")
    finally:
        pool.send_signal(signal.SIGTERM)
        code = pool.wait(30)
    assert code == 0, log.text()
    for m in ("q-1", "q-2"):
        assert f"member {m} left:" in log.text()  # each member's own graceful-leave summary
    after = _status(url, unique_name, capsys)
    assert after["members"] == [] and all(p["owner"] is None for p in after["partitions"])


def test_a_member_that_does_not_leave_in_time_is_killed_and_the_pool_exits_1(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0
    pool = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "pool", "--size", "1"]
        + ["--member-prefix", "s", "--stream", unique_name, "--group", "g"]
        + ["--handler", "chaos_handlers:StuckClose", "--stop-timeout", "1", "--server", url],
        env=dict(os.environ, PYTHONPATH=str(TESTS)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = Lines(pool.stderr)
    try:
        wait_for(lambda: "member s-1 joined group g" in log.text(), 30, "the member to join")
    finally:
        pool.send_signal(signal.SIGTERM)
        code = pool.wait(30)
    assert code == 1, log.text()
    assert "member s-1 did not leave within 1s; killing it" in log.text()
    assert "not every member left gracefully: s-1 (killed by SIGKILL)" in log.text()


def test_members_get_the_pools_worker_and_connection_flags():
    args = build_parser().parse_args(
        ["pool", "--size", "2", "--stream", "S", "--group", "G", "--handler", "m:f"]
        + ["--lease-ttl", "3", "--batch-handler", "--server", "nats://a:4222"]
        + ["-s", "nats://b:4222", "--max-buffer-bytes", "1MiB", "-vv", "--conn-id", "x"]
    )
    argv = member_argv(args)
    assert argv == [
        "--stream", "S", "--group", "G", "--handler", "m:f", "--lease-ttl", "3.0",
        "--batch-handler", "--max-buffer-bytes", "1048576",
        "--server", "nats://a:4222", "--server", "nats://b:4222", "--conn-id", "x",
        "--verbose", "--verbose",
    ]  # fmt: skip
    # and what they get parses back to the same worker settings
    back = build_parser().parse_args(["worker", *argv])
    for name in ("stream", "lease_ttl", "batch_handler", "max_buffer_bytes", "server", "verbose"):
        assert getattr(back, name) == getattr(args, name), name


def _supervise(
    argv: list[str], until: Callable[[list[str]], bool], deadline: float = 90.0, **kw
) -> tuple[int, list[str]]:
    """Run a Supervisor of one member until its log satisfies ``until`` (or ``deadline``
    seconds pass, a bound only a broken pool reaches), then stop it; its exit code and log.
    Nothing here depends on how fast the machine is: the test asserts on what was logged."""
    lines: list[str] = []

    async def main() -> int:
        sup = Supervisor({"m-1": argv}, stop_timeout=5, log=lines.append, **kw)

        async def stop_when_seen() -> None:
            end = time.monotonic() + deadline
            while not until(lines) and time.monotonic() < end:
                await asyncio.sleep(0.05)
            sup.stop(signal.SIGTERM)

        stopper = asyncio.ensure_future(stop_when_seen())
        try:
            return await sup.run()
        finally:
            stopper.cancel()

    return asyncio.run(main()), lines


_DELAY = re.compile(r"exited \(exit code 3\) after .*; restarting it in ([\d.]+)s")


def _delays(lines: list[str]) -> list[str]:
    return _DELAY.findall("\n".join(lines))


def test_restart_delay_doubles_up_to_the_cap_for_a_member_that_keeps_crashing():
    code, lines = _supervise(
        [sys.executable, "-c", "import sys; sys.exit(3)"],
        lambda lines: len(_delays(lines)) >= 5,
        backoff=0.1,
        backoff_max=0.4,
        reset_after=60,
    )
    assert _delays(lines)[:5] == ["0.1", "0.2", "0.4", "0.4", "0.4"], lines
    assert code == 0  # it was not running when the pool stopped: nothing failed to leave


def test_restart_delay_starts_over_for_a_member_that_ran_long_enough():
    code, lines = _supervise(
        [sys.executable, "-c", "import sys, time; time.sleep(0.4); sys.exit(3)"],
        lambda lines: len(_delays(lines)) >= 3,
        backoff=0.1,
        backoff_max=0.4,
        reset_after=0.3,
    )
    delays = _delays(lines)
    assert len(delays) >= 3 and set(delays) == {"0.1"}, lines
