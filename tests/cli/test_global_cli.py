"""``nats-ordered global-read`` (issue 18 part 1): a real process merging a global-order
stream into one handler, stopped by SIGTERM and started again; its help and usage errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import nats

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.group.global_position import POSITION_KEY
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

HANDLER = """
import os
import time

def apply(msg):
    time.sleep(float(os.environ.get("GLOBAL_DELAY", "0")))
    with open(os.environ["GLOBAL_OUT"], "a") as f:
        f.write(f"{msg.global_seq} {msg.partition} {msg.data.decode()}\\n")
"""


async def _publish(url: str, stream: str, first: int, n: int) -> None:
    nc = await nats.connect(url)
    try:
        async with OrderedPublisher(nc, stream, global_order=GlobalOrder()) as pub:
            for i in range(first, first + n):
                await pub.publish(f"k{i % 11}", b"%d" % i)
    finally:
        await nc.close()


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _read_until(proc, out, count: int) -> None:
    deadline = time.monotonic() + 90  # a process start on a loaded machine
    while len(_lines(out)) < count:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{len(_lines(out))} of {count} lines"
        time.sleep(0.1)


def test_global_read_hands_over_one_order_and_resumes_after_sigterm(
    shared_nats_server, unique_name, tmp_path
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "3", "--server", url]) == 0
    asyncio.run(_publish(url, unique_name, 0, 40))
    (tmp_path / "ledger.py").write_text(HANDLER)
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "airflow_nats_ordered.cli", "global-read"]
    cmd += ["--stream", unique_name, "--group", "ledger", "--handler", "ledger:apply"]
    cmd += ["--server", url]
    env = dict(os.environ, GLOBAL_OUT=str(out))

    def run_once(count: int) -> str:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        try:
            _read_until(proc, out, count)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        return err

    err = run_once(40)
    assert "resuming after global sequence 0" in err and "40 records handled" in err
    asyncio.run(_publish(url, unique_name, 40, 20))  # while no reader runs
    err = run_once(60)
    assert "resuming after global sequence 40" in err  # the position written on SIGTERM
    lines = [line.split() for line in _lines(out)]
    assert [int(g) for g, _, _ in lines] == list(range(1, 61))  # once each, in order
    assert [int(d) for _, _, d in lines] == list(range(60))  # which is publish order
    assert len({p for _, p, _ in lines}) == 3

    async def position() -> dict:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(f"nor_{unique_name}_ledger_state")
            return json.loads((await kv.get(POSITION_KEY)).value)
        finally:
            await nc.close()

    assert asyncio.run(position())["g"] == 60


def test_global_read_help_and_a_bad_handler(shared_nats_server, unique_name, capsys):
    assert cli(["global-read", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--max-buffer-bytes" in help_text and "global order" in help_text
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    capsys.readouterr()
    code = cli(
        ["global-read", "--stream", unique_name, "--group", "g", "--handler", "nosuch:f"]
        + ["--server", url]
    )
    assert code == 2
    assert "nosuch" in capsys.readouterr().err


def test_global_read_killed_mid_merge_resumes_exactly_after_its_written_position(
    shared_nats_server, unique_name, tmp_path
):
    """SIGKILL while records are being handed over: nothing is written at the end. The
    next process says where it resumes, and hands over exactly the records after that
    position, in order; together nothing is lost."""
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "3", "--server", url]) == 0
    asyncio.run(_publish(url, unique_name, 0, 60))
    (tmp_path / "ledger.py").write_text(HANDLER)
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "airflow_nats_ordered.cli", "global-read", "--stream"]
    cmd += [unique_name, "--group", "g", "--handler", "ledger:apply", "--commit-every", "7"]
    cmd += ["--server", url]
    env = dict(os.environ, GLOBAL_OUT=str(out), GLOBAL_DELAY="0.02")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _read_until(proc, out, 20)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    first = [int(line.split()[0]) for line in _lines(out)]
    assert first == list(range(1, len(first) + 1)) and len(first) < 60
    out.unlink()
    env["GLOBAL_DELAY"] = "0"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _read_until(proc, out, 1)
        deadline = time.monotonic() + 60
        while not _lines(out) or int(_lines(out)[-1].split()[0]) < 60:
            assert time.monotonic() < deadline, _lines(out)
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    resumed = int(err.split("resuming after global sequence ")[1].split()[0])
    # written every 7 records before the next is handed over: at least 14 of the 20 or more
    # the first process handled are behind it, and it never runs ahead of what was handled
    assert 14 <= resumed <= len(first)
    second = [int(line.split()[0]) for line in _lines(out)]
    assert second == list(range(resumed + 1, 61))  # exactly what followed, in order
