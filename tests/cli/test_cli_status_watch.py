"""`nats-ordered status --watch`: a refreshing view until Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time

import nats

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.store import GroupStore

WATCH = [sys.executable, "-m", "airflow_nats_ordered.cli", "status", "--watch"]


def _group(url: str, stream: str, capsys) -> None:
    """A stream with a group that has state (a worker ran once), and 5 messages unread."""
    assert cli(["provision", "--stream", stream, "--partitions", "2", "--server", url]) == 0

    async def create() -> None:
        nc = await nats.connect(url)
        try:
            await GroupStore.open(nc, GroupConfig(stream, "g", 5.0))
        finally:
            await nc.close()

    asyncio.run(create())
    capsys.readouterr()


def _publish(url: str, stream: str, n: int, tmp_path, capsys) -> None:
    rows = tmp_path / f"rows{n}.jsonl"
    rows.write_text("".join(json.dumps({"k": f"k{i}", "i": i}) + "\n" for i in range(n)))
    args = ["publish", "--stream", stream, str(rows), "--key-field", "k", "--server", url]
    assert cli(args) == 0
    capsys.readouterr()


def test_watch_json_prints_one_document_per_refresh_until_ctrl_c_and_exits_0(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    _group(url, unique_name, capsys)
    proc = subprocess.Popen(
        [*WATCH, "--json", "--interval", "0.3", "--stream", unique_name, "--group", "g"]
        + ["--server", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        assert first["total_lag"] == 0 and first["stream"] == unique_name
        _publish(url, unique_name, 5, tmp_path, capsys)
        docs = []
        deadline = time.monotonic() + 20
        while not docs or docs[-1]["total_lag"] != 5:
            assert time.monotonic() < deadline, docs
            docs.append(json.loads(proc.stdout.readline()))  # every line one whole document
        assert docs[-1]["ts"] > first["ts"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    for line in out.splitlines():  # what was printed after Ctrl-C is whole lines too
        json.loads(line)


def test_watch_redraws_in_place_on_a_terminal_and_repeats_tables_otherwise(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    _group(url, unique_name, capsys)
    args = [*WATCH, "--interval", "0.2", "--stream", unique_name, "--group", "g", "--server", url]
    # not a terminal: plain tables one after another
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120  # three tables, however slow the start: a hang bound
    while sum("(Ctrl-C to stop)" in ln for ln in lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, err
    assert "\x1b[" not in out
    assert out.count("partition  owner") >= 3 and out.count("(Ctrl-C to stop)") >= 3
    # a terminal: cursor home, lines cleared to their end, the rest of the screen cleared
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=slave, stderr=subprocess.PIPE, text=True)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 120  # a bound on a hang, not a speed
    while seen.count(b"\x1b[H") < 3 and time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            seen += os.read(master, 65536)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    os.close(master)
    assert proc.returncode == 0, err
    frames = seen.split(b"\x1b[H")[1:]
    assert len(frames) >= 3
    for frame in frames[:-1]:
        assert b"partition  owner" in frame and frame.endswith(b"\x1b[J")
        assert b"\x1b[K" in frame


def test_watch_refuses_flags_of_other_modes(capsys):
    assert cli(["status", "--stream", "S", "--group", "g", "--watch", "--wait-drained"]) == 2
    assert "--watch and --wait-drained do not combine" in capsys.readouterr().err
    assert cli(["status", "--stream", "S", "--group", "g", "--interval", "1s"]) == 2
    assert "--interval applies to --watch" in capsys.readouterr().err
