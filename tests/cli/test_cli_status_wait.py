"""`nats-ordered status --wait-drained` never hangs on a group nobody consumes, waits for a
group whose workers are still starting, and `status` lists a blocked partition under
`problems` (issue 15 items 4 and 8). Real nats-server, real workers, the real CLI."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import nats
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin import drain
from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

CONSOLE_SCRIPT = Path(sys.executable).with_name("nats-ordered")
N = 120
#: a bound on a hang (process start-up on a loaded machine included), not a speed
DEADLINE = 90.0


def _stream(url: str, stream: str, tmp_path: Path, capsys) -> None:
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 9}", "i": i} for i in range(N)))
    assert cli(["provision", "--stream", stream, "--partitions", "4", "--server", url]) == 0
    assert cli(["publish", "--stream", stream, str(rows), "--key-field", "k", "--server", url]) == 0
    capsys.readouterr()


def _cfg(stream: str, **kw) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2, **kw)


def _create_group(url: str, stream: str) -> None:
    """The group as its first member leaves it: state, and nobody running."""

    async def go() -> None:
        nc = await nats.connect(url)
        await GroupStore.open(nc, _cfg(stream).group_config)
        await nc.close()

    asyncio.run(go())


def _status(url: str, stream: str, *extra: str, code: str | None = None) -> subprocess.Popen:
    """``status --wait-drained --json`` in its own process; ``code`` runs before the CLI
    (e.g. to lower the default no-members timeout, which the CLI reads when it runs)."""
    argv = ["status", "--stream", stream, "--group", "g", "--wait-drained", "--json"]
    argv += [*extra, "--server", url]
    if code is None:
        cmd = [str(CONSOLE_SCRIPT), *argv]
    else:
        main = f"{code}\nfrom airflow_nats_ordered.cli import main\nsys.exit(main({argv!r}))"
        cmd = [sys.executable, "-c", f"import sys\n{main}"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"status --wait-drained still waiting after {DEADLINE:g}s: {err[-600:]}"
        ) from None
    return proc.returncode, out, err


def test_the_python_default_bounds_a_wait_on_a_group_nobody_consumes():
    default = inspect.signature(wait_drained).parameters["no_members_timeout"].default
    assert default == getattr(drain, "DEFAULT_NO_MEMBERS_TIMEOUT", None) == 60.0


def test_wait_drained_exits_1_when_nobody_consumes_the_group_by_default(
    shared_nats_server, unique_name, tmp_path, capsys
):
    """No flag: the default no-members timeout applies (lowered to 1 s in the process, so
    the test does not wait the real 60 s for it)."""
    url = shared_nats_server.url
    _stream(url, unique_name, tmp_path, capsys)
    _create_group(url, unique_name)
    lower = "import airflow_nats_ordered.cli.status as s; s.DEFAULT_NO_MEMBERS_TIMEOUT = 1.0"
    rc, out, err = _finish(_status(url, unique_name, code=lower))
    assert rc == 1, err
    assert f"no worker pool is consuming group g of stream {unique_name}" in err
    assert "no member has been alive for 1s" in err and "nats-ordered worker" in err
    assert "--no-members-timeout" in err
    st = json.loads(out)
    assert st["drained"] is False and st["total_lag"] == N and st["members"] == []


def test_no_members_timeout_flag_bounds_the_wait_and_0_waits_anyway(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _stream(url, unique_name, tmp_path, capsys)
    _create_group(url, unique_name)
    rc, out, err = _finish(_status(url, unique_name, "--no-members-timeout", "2s"))
    assert rc == 1, err
    assert "no member has been alive for 2s" in err
    assert json.loads(out)["drained"] is False
    # 0: wait for the workers without limit (here the --timeout ends it: exit 1 too)
    rc, out, err = _finish(
        _status(url, unique_name, "--no-members-timeout", "0", "--timeout", "3s")
    )
    assert rc == 1, err
    assert "did not drain within 3s" in err and "no worker pool" not in err
    # the flag belongs to --wait-drained
    base = ["status", "--stream", unique_name, "--group", "g", "--server", url]
    assert cli([*base, "--no-members-timeout", "5s"]) == 2
    assert "--no-members-timeout applies to --wait-drained" in capsys.readouterr().err


def test_wait_drained_waits_for_a_group_whose_workers_are_starting(
    shared_nats_server, unique_name, tmp_path, capsys
):
    """Right after `nats-ordered worker` is started the group may have no state yet: the
    wait waits for it, then for the drain, and exits 0."""
    url = shared_nats_server.url
    _stream(url, unique_name, tmp_path, capsys)
    proc = _status(url, unique_name, "--timeout", "90s")
    seen: list[int] = []
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the first progress line: the group is not there
        assert "waiting for group g to appear: no worker has joined it yet" in first, first

        async def workers() -> int:
            async with WorkerPool(url, _cfg(unique_name), seen.append, size=2):
                loop = asyncio.get_running_loop()
                return await asyncio.wait_for(loop.run_in_executor(None, proc.wait), DEADLINE)

        asyncio.run(workers())
        rc, out, err = _finish(proc)
    finally:
        proc.kill()
    assert rc == 0, err
    assert "4 of 4 partitions at their mark" in err
    st = json.loads(out)
    assert st["drained"] is True and st["total_lag"] == 0
    assert len(seen) >= N


def test_wait_drained_on_a_group_that_never_appears_exits_1_and_says_so(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _stream(url, unique_name, tmp_path, capsys)
    rc, out, err = _finish(_status(url, unique_name, "--no-members-timeout", "1s"))
    assert rc == 1, err
    assert "Traceback" not in err
    assert "has no state yet: no worker joined it within 1s" in err
    assert f"nats-ordered worker --stream {unique_name} --group g" in err
    assert "check the group name" in err
    st = json.loads(out)
    assert st["exists"] is False and st["drained"] is False
    assert "has no state yet" in st["problems"][0]


def test_status_lists_a_blocked_partition_under_problems(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _stream(url, unique_name, tmp_path, capsys)

    def handler(msg):
        if json.loads(msg.data)["i"] == 60:
            raise RuntimeError("downstream rejected")

    async def until_blocked() -> int:
        cfg = _cfg(unique_name, poison="block", max_retries=0)
        async with WorkerPool(url, cfg, handler, size=1):
            nc = await nats.connect(url)
            try:
                deadline = time.monotonic() + DEADLINE
                while True:
                    lag = await read_lag(nc, unique_name, "g")
                    blocked = [p.partition for p in lag.partitions if p.blocked]
                    if blocked:
                        return blocked[0]
                    assert time.monotonic() < deadline, "no partition blocked"
                    await asyncio.sleep(0.1)
            finally:
                await nc.close()

    p = asyncio.run(until_blocked())  # the marker stays after the member left
    base = ["status", "--stream", unique_name, "--group", "g", "--server", url]
    assert cli([*base, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["partitions"][p]["blocked"]
    mine = [x for x in st["problems"] if x.startswith(f"partition {p} is blocked")]
    assert len(mine) == 1, st["problems"]
    assert "downstream rejected" in mine[0] and "--poison dead-letter" in mine[0]
    assert cli(base) == 0
    table = capsys.readouterr().out
    assert f"problems:\n  - partition {p} is blocked: blocked at seq" in table
