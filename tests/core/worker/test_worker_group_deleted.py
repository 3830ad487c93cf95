"""A member whose group is deleted under it (`group delete --force`) stops once, with exit 3
and why, instead of warning in a loop for ever; a pool does not restart such members and
exits 3 when none is left (issue 15 item 5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from locations import TESTS

from airflow_nats_ordered.cli import main as cli


def _pythonpath() -> str:
    """The tests' helpers, after whatever PYTHONPATH the run was given (a checkout to test:
    members started elsewhere than the checkout must import it, not the installed one)."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p)


class _Log:
    """A process's stderr, read by a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, proc: subprocess.Popen, count: int = 1) -> None:
        end = time.monotonic() + 60
        while self.text().count(text) < count:
            assert proc.poll() is None, self.text()
            assert time.monotonic() < end, f"never saw {text!r}:\n{self.text()}"
            time.sleep(0.05)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", *args],
        env=dict(os.environ, PYTHONPATH=_pythonpath()),
        stderr=subprocess.PIPE,
        text=True,
    )


def _end(proc: subprocess.Popen, log: _Log) -> int:
    """The exit code of a process that must end by itself (generous bound, then killed)."""
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise AssertionError(
            f"it did not stop after the group was deleted:\n{log.text()[-4000:]}"
        ) from None


def _wait_owned(url: str, stream: str, proc: subprocess.Popen, log: _Log, capsys) -> None:
    """Until every partition of the group has an owner (the members are at work)."""
    end = time.monotonic() + 60
    while True:
        code = cli(["status", "--stream", stream, "--group", "g", "--json", "--server", url])
        out = capsys.readouterr()
        if code == 0 and all(p["owner"] for p in json.loads(out.out)["partitions"]):
            return
        assert proc.poll() is None, log.text()
        assert time.monotonic() < end, f"the partitions were never owned:\n{log.text()}"
        time.sleep(0.2)


def _delete(url: str, stream: str, capsys) -> None:
    code = cli(["group", "delete", "--stream", stream, "--group", "g", "--force", "--server", url])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()


def test_a_worker_stops_with_exit_3_once_its_group_is_deleted_under_it(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "4", "--server", url]) == 0
    capsys.readouterr()
    proc = _start(
        ["worker", "--stream", unique_name, "--group", "g", "--member-id", "w1"]
        + ["--handler", "chaos_handlers:ignore", "--lease-ttl", "2", "--server", url]
    )
    log = _Log(proc)
    log.wait_for("joined group g", proc)
    _wait_owned(url, unique_name, proc, log, capsys)
    _delete(url, unique_name, capsys)
    code = _end(proc, log)
    text = log.text()
    assert code == 3, text
    assert (
        f"error: member w1 stopped: group g of stream {unique_name} was deleted while this "
        "member ran" in text
    ), text
    assert "Starting a member again creates the group afresh" in text
    # once, not a warning per loop for ever (the old worker logged ~70 per second)
    warnings = [line for line in text.splitlines() if line.startswith("WARNING")]
    assert len(warnings) <= 20, text
    # and it did not create the group again on its way out
    code = cli(["status", "--stream", unique_name, "--group", "g", "--server", url])
    assert code == 2 and "no state yet" in capsys.readouterr().err


def test_a_pool_does_not_restart_members_of_a_deleted_group_and_exits_3(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "4", "--server", url]) == 0
    capsys.readouterr()
    proc = _start(
        ["pool", "--size", "2", "--member-prefix", "d", "--stream", unique_name, "--group", "g"]
        + ["--handler", "chaos_handlers:ignore", "--lease-ttl", "2", "--server", url]
    )
    log = _Log(proc)
    log.wait_for("joined group g", proc, count=2)
    _wait_owned(url, unique_name, proc, log, capsys)
    _delete(url, unique_name, capsys)
    code = _end(proc, log)
    text = log.text()
    assert code == 3, text
    for m in ("d-1", "d-2"):
        assert f"pool: member {m} exited (exit code 3): group g of {unique_name} was deleted" in (
            text
        ), text
    assert "restarting it in" not in text, text
    assert "pool: no member left to run" in text
    code = cli(["status", "--stream", unique_name, "--group", "g", "--server", url])
    assert code == 2 and "no state yet" in capsys.readouterr().err  # not begun afresh
