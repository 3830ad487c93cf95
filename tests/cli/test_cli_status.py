"""`nats-ordered status --wait-drained` and the status fields, with real workers."""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import sys
from pathlib import Path

import nats
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

CONSOLE_SCRIPT = Path(sys.executable).with_name("nats-ordered")
N = 300


def _setup(url, stream, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 9}", "i": i} for i in range(N)))
    assert cli(["provision", "--stream", stream, "--partitions", "4", "--server", url]) == 0
    assert cli(["publish", "--stream", stream, str(rows), "--key-field", "k", "--server", url]) == 0
    capsys.readouterr()

    async def create_group():  # as the first member does when it joins
        nc = await nats.connect(url)
        await GroupStore.open(nc, _cfg(stream).group_config)
        await nc.close()

    asyncio.run(create_group())


def _cfg(stream, **kw):
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2, **kw)


def _wait_drained_process(url, stream, *extra):
    return subprocess.Popen(
        [CONSOLE_SCRIPT, "status", "--stream", stream, "--group", "g", "--wait-drained"]
        + [*extra, "--json", "--server", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line the process writes to stderr (fails after ``timeout`` seconds)."""
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    assert ready, f"no progress on stderr within {timeout:g}s"
    return proc.stderr.readline()


async def _run_pool_until_exit(url, cfg, handler, proc, timeout=300.0):
    """Run a real pool while the status process waits; return its exit code (the timeout
    bounds a hang; a loaded machine may take a while to start the processes)."""
    async with WorkerPool(url, cfg, handler, size=2):
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(None, proc.wait), timeout)


def test_wait_drained_waits_for_the_workers_then_exits_0_with_drained_status(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _setup(url, unique_name, tmp_path, capsys)
    seen = []
    proc = _wait_drained_process(url, unique_name, "--timeout", "300")
    try:
        # the wait has read its marks once it shows progress: a fixed sleep before starting
        # the workers was shorter than the command's start on a loaded machine (the pool
        # drained first, and the wait began at its marks)
        first = _first_line(proc, 120)
        assert proc.poll() is None, "returned although no worker ran"
        rc = asyncio.run(_run_pool_until_exit(url, _cfg(unique_name), seen.append, proc))
        out, err = proc.communicate(timeout=10)
        err = first + err
    finally:
        proc.kill()
    assert rc == 0, err
    assert "of 4 partitions at their mark; behind: partition 0 at 0 of " in err
    assert "4 of 4 partitions at their mark" in err
    st = json.loads(out)
    assert st["drained"] is True and st["total_lag"] == 0
    assert len(seen) >= N  # returned after the work (at-least-once: maybe more)
    assert st["dead_letters"]["stream"] == f"{unique_name}_DLQ"
    assert st["dead_letters"]["subjects"] == f"{unique_name.lower()}.dlq.g.*"
    assert st["problems"] == []


def test_wait_drained_timeout_exits_1_and_shows_the_lag(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _setup(url, unique_name, tmp_path, capsys)
    base = ["status", "--stream", unique_name, "--group", "g", "--server", url]
    rc = cli([*base, "--wait-drained", "--timeout", "1s", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "did not drain within 1s: 3 partition(s) behind" in err and "--timeout" in err
    st = json.loads(out)
    assert st["drained"] is False and st["total_lag"] == N
    # without waiting, status reports the same lag and exits 0
    assert cli([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_lag"] == N
    # --timeout alone is a usage error
    assert cli([*base, "--timeout", "5"]) == 2
    assert "--timeout applies to --wait-drained" in capsys.readouterr().err


def test_wait_drained_exits_3_at_once_when_a_partition_is_blocked(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _setup(url, unique_name, tmp_path, capsys)

    def handler(msg):
        if json.loads(msg.data)["i"] == 100:
            raise RuntimeError("downstream rejected")

    # exit 3 for the block, not 1 for the 600 s timeout: it failed fast for the right reason
    proc = _wait_drained_process(url, unique_name, "--timeout", "600")
    try:
        cfg = _cfg(unique_name, poison="block", max_retries=0)
        rc = asyncio.run(_run_pool_until_exit(url, cfg, handler, proc))
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert rc == 3, err
    assert "is blocked on a poison message" in err and "downstream rejected" in err
    assert "--poison dead-letter" in err
    st = json.loads(out)
    assert st["drained"] is False
    assert [p["partition"] for p in st["partitions"] if p["blocked"]]


def test_status_table_names_the_dead_letter_stream_and_problems(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _setup(url, unique_name, tmp_path, capsys)

    def handler(msg):
        if json.loads(msg.data)["i"] % 50 == 0:
            raise RuntimeError("rejected")

    async def drain():
        cfg = _cfg(unique_name, max_retries=0, retry_backoff=0.01)
        from airflow_nats_ordered.core.admin.drain import wait_drained

        async with WorkerPool(url, cfg, handler, size=1):
            nc = await nats.connect(url)
            await wait_drained(nc, unique_name, "g", timeout=30)
            await nc.close()

    asyncio.run(drain())
    assert cli(["status", "--stream", unique_name, "--group", "g", "--server", url]) == 0
    out = capsys.readouterr().out
    dlq = f"{unique_name.lower()}.dlq.g.*"
    assert f"dead letters: {N // 50} in stream {unique_name}_DLQ ({dlq})" in out
    assert "lag 0, drained" in out and "problems:" not in out

    async def delete_a_commit_record():  # an operator's mistake the group must report
        nc = await nats.connect(url)
        kv = await nc.jetstream().key_value(f"nor_{unique_name}_g_state")
        await kv.delete("c.0")
        await nc.close()

    asyncio.run(delete_a_commit_record())
    assert cli(["status", "--stream", unique_name, "--group", "g", "--server", url]) == 0
    out = capsys.readouterr().out
    assert "problems:\n  - partition 0: commit record c.0 was deleted" in out
    assert cli(["status", "--stream", unique_name, "--group", "g", "--json", "--server", url]) == 0
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any("commit record c.0 was deleted" in p for p in problems)
