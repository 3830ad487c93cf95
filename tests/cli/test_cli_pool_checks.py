"""`nats-ordered pool` checks before it starts members, and stops a member that cannot start
(issue 15 item 3): no endless restart loop for a bad handler, server or password."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from locations import TESTS

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.cli.pool import Supervisor
from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.embedded.servers import NatsServer


def _pythonpath() -> str:
    """The tests' helpers, after whatever PYTHONPATH the run was given (a checkout to test:
    members started elsewhere than the checkout must import it, not the installed one)."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p)


PASSWORD = "s3cret-pool-pw"


def _pool(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None):
    """Run a pool to its end (a generous bound only a pool that never stops reaches)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "pool", "--member-prefix", "c"] + args,
        env=dict(os.environ, PYTHONPATH=_pythonpath(), **(env or {})),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        pytest.fail(f"the pool did not stop by itself:\n{err[-3000:]}")
    return proc.returncode, err


def _started(err: str) -> int:
    return len(re.findall(r"pool: member c-\d started", err))


@pytest.mark.parametrize(
    "handler,expected",
    [
        ("no_such_module_x:apply", "cannot import handler module 'no_such_module_x'"),
        ("chaos_handlers:nope", "module 'chaos_handlers' has no attribute 'nope'"),
        ("chaos_handlers:EVENTS_DDL", "is not callable"),
    ],
)
def test_a_bad_handler_exits_2_before_any_member_starts(
    shared_nats_server, unique_name, handler, expected
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    code, err = _pool(
        ["--size", "2", "--stream", unique_name, "--group", "g", "--handler", handler]
        + ["--server", url]
    )
    assert code == 2, err
    assert expected in err, err
    assert _started(err) == 0, err


def test_an_unreachable_server_or_unknown_stream_exits_2_before_any_member_starts(
    shared_nats_server, unique_name
):
    base = ["--size", "2", "--group", "g", "--handler", "chaos_handlers:ignore"]
    code, err = _pool(
        [*base, "--stream", unique_name, "--server", f"nats://127.0.0.1:{free_port()}"]
    )
    assert code == 2 and "could not connect" in err and _started(err) == 0, err
    code, err = _pool([*base, "--stream", unique_name, "--server", shared_nats_server.url])
    assert code == 2 and unique_name in err and _started(err) == 0, err


def test_a_wrong_password_exits_2_before_any_member_starts(tmp_path):
    config = f'authorization {{ user: alice, password: "{PASSWORD}" }}'
    with NatsServer(tmp_path / "nats", extra_config=config) as server:
        good = {"NATS_USER": "alice", "NATS_PASSWORD": PASSWORD}
        provision = [sys.executable, "-m", "airflow_nats_ordered.cli", "provision"]
        done = subprocess.run(
            [*provision, "--stream", "AUTHP", "--partitions", "2", "--server", server.url],
            env=dict(os.environ, **good),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        code, err = _pool(
            ["--size", "2", "--stream", "AUTHP", "--group", "g"]
            + ["--handler", "chaos_handlers:ignore", "--server", server.url],
            env={"NATS_USER": "alice", "NATS_PASSWORD": "wrong-password"},
        )
    assert code == 2 and "alice" in err and _started(err) == 0, err
    assert "wrong-password" not in err and PASSWORD not in err


def test_a_member_that_cannot_start_three_times_in_a_row_stops_the_pool_with_its_error(
    shared_nats_server, unique_name, tmp_path
):
    """The pool's own checks pass (the class exists and takes stream and group); creating
    it fails in every member: the third failure in a row stops the pool."""
    (tmp_path / "fragile_handler.py").write_text(
        "class Sink:\n"
        "    def __init__(self, stream, group):\n"
        "        raise RuntimeError('the sink database is unreachable')\n"
        "    def __call__(self, msg):\n"
        "        pass\n"
    )
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    code, err = _pool(
        ["--size", "2", "--stream", unique_name, "--group", "g"]
        + ["--handler", "fragile_handler:Sink", "--restart-backoff", "0.1", "--server", url],
        cwd=tmp_path,
    )
    assert code == 2, err
    assert re.search(
        r"error: member c-\d could not start 3 times in a row \(exit code 2\): handler class "
        r"'fragile_handler:Sink' could not be created: RuntimeError: the sink database is "
        r"unreachable",
        err,
    ), err
    assert err.rstrip().splitlines()[-1].startswith("error: member c-"), err
    assert _started(err) <= 6, err  # at most three runs of each member, then nothing more


def _supervise_until_done(argv: list[str], **kw) -> tuple[int, list[str]]:
    lines: list[str] = []

    async def main() -> int:
        sup = Supervisor({"m-1": argv}, stop_timeout=5, log=lines.append, **kw)
        return await asyncio.wait_for(sup.run(), 90)

    return asyncio.run(main()), lines


def test_start_failures_in_a_row_stop_the_supervisor_but_crashes_after_start_do_not():
    # exit 2 (could not start) three times: the supervisor stops with 2 and the error
    code, lines = _supervise_until_done(
        [sys.executable, "-c", "import sys; print('error: nope', file=sys.stderr); sys.exit(2)"],
        backoff=0.05,
        backoff_max=0.1,
        reset_after=60,
        max_start_failures=3,
    )
    assert code == 2, lines
    assert "error: member m-1 could not start 3 times in a row (exit code 2): nope" in lines
    assert sum("started (pid" in line for line in lines) == 3, lines

    # exit 3 (a crash after start) keeps the restart loop with backoff: stopped from outside
    crashes: list[str] = []

    async def crash_loop() -> int:
        sup = Supervisor(
            {"m-1": [sys.executable, "-c", "import sys; sys.exit(3)"]},
            stop_timeout=5,
            log=crashes.append,
            backoff=0.05,
            backoff_max=0.1,
            reset_after=60,
            max_start_failures=3,
        )
        run = asyncio.ensure_future(sup.run())
        end = time.monotonic() + 90
        while sum("restarting it" in c for c in crashes) < 5 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        sup.stop(signal.SIGTERM)
        return await run

    assert asyncio.run(crash_loop()) == 0, crashes
    assert sum("restarting it" in c for c in crashes) >= 5, crashes


def test_members_that_cannot_start_during_a_server_outage_are_restarted_not_given_up(
    nats_server, unique_name
):
    """A member restarted while the server is down exits 2 (cannot connect) at every try;
    that is an outage, not a member that cannot start: the pool keeps restarting it with
    backoff and it joins again when the server is back, instead of the pool giving up."""
    url = nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "pool", "--member-prefix", "c"]
        + ["--size", "1", "--stream", unique_name, "--group", "g"]
        + ["--handler", "chaos_handlers:ignore", "--server", url, "--connect-timeout", "2"]
        + ["--restart-backoff", "0.2", "--restart-backoff-max", "1", "--max-start-failures", "3"],
        env=dict(os.environ, PYTHONPATH=_pythonpath()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()

    def wait_for(cond, what: str) -> None:
        deadline = time.monotonic() + 120  # a bound on a hang, not a speed
        while not cond():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{what}: pool exit {proc.poll()}\n" + "".join(lines[-40:]))
            time.sleep(0.2)

    try:
        wait_for(lambda: any("joined group g" in ln for ln in lines), "the member to join")
        pid = int(re.search(r"member c-1 started \(pid (\d+)\)", "".join(lines)).group(1))
        nats_server.stop()
        os.kill(pid, signal.SIGKILL)  # restarted while the server is down
        wait_for(
            lambda: sum("not counted" in ln for ln in lines) >= 5,  # > --max-start-failures
            "five start failures during the outage",
        )
        joined = sum("joined group g" in ln for ln in lines)
        nats_server.start()
        wait_for(
            lambda: sum("joined group g" in ln for ln in lines) > joined,
            "the member to join again after the outage",
        )
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        reader.join(timeout=10)
    assert code == 0, "".join(lines[-40:])
    assert not any("could not start 3 times in a row" in ln for ln in lines)
