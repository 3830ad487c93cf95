"""The CLI of several producers in one exact event-time order (issue 18 part 1):
``global-read --order-by event-time --watermarks`` as a real process, ``global-producers``
listing and closing producers, and their usage errors. Real shared server."""

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
from airflow_nats_ordered.core.order.producer import GlobalProducer
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

T0 = 1_795_000_000_000  # epoch ms
HANDLER = """
import os

def apply(msg):
    with open(os.environ["GLOBAL_OUT"], "a") as f:
        f.write(msg.data.decode() + "\\n")
"""


async def _produce(url: str, stream: str, close: bool = True) -> None:
    """Producers 'a' (even ms) and 'b' (odd ms, and at every 5th record the same ms as 'a'),
    publishing in turns."""
    nc = await nats.connect(url)
    try:
        a = GlobalProducer(OrderedPublisher(nc, stream), "a")
        b = GlobalProducer(OrderedPublisher(nc, stream), "b")
        await a.start()
        await b.start()
        for i in range(15):
            await b.publish(f"k{i % 4}", b"b%02d" % i, event_time=T0 + 2 * i + (i % 5 > 0))
            await a.publish(f"k{i % 3}", b"a%02d" % i, event_time=T0 + 2 * i)
        if close:
            await a.close()
            await b.close()
        else:  # both "die" after a watermark
            await a.watermark()
            await b.watermark()
    finally:
        await nc.close()


def _expected() -> list[str]:
    keys = [((2 * i, "a"), f"a{i:02d}") for i in range(15)]
    keys += [((2 * i + (i % 5 > 0), "b"), f"b{i:02d}") for i in range(15)]
    return [d for _, d in sorted(keys)]


def test_global_read_watermarks_process_merges_two_producers(
    shared_nats_server, unique_name, tmp_path
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "3", "--server", url]) == 0
    asyncio.run(_produce(url, unique_name))
    (tmp_path / "ledger.py").write_text(HANDLER)
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "airflow_nats_ordered.cli", "global-read", "--stream"]
    cmd += [unique_name, "--group", "g", "--handler", "ledger:apply", "--server", url]
    cmd += ["--order-by", "event-time", "--watermarks"]
    env = dict(os.environ, GLOBAL_OUT=str(out))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90  # a process start on a loaded machine
        while len(out.read_text().splitlines() if out.exists() else []) < 30:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, out.read_text() if out.exists() else ""
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "30 records handled" in err and "late" not in err, err
    # equal event times: producer a before b
    assert out.read_text().splitlines() == _expected()


def test_global_producers_lists_and_closes(shared_nats_server, unique_name, capsys):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    capsys.readouterr()
    assert cli(["global-producers", "--stream", unique_name, "--server", url]) == 0
    assert "has no global producers" in capsys.readouterr().out
    code = cli(["global-producers", "--stream", unique_name, "--close", "a", "--server", url])
    assert code == 2
    assert "has no global producers" in capsys.readouterr().err
    asyncio.run(_produce(url, unique_name, close=False))  # a and b left open: "died"
    assert cli(["global-producers", "--stream", unique_name, "--json", "--server", url]) == 0
    listed = json.loads(capsys.readouterr().out)["producers"]
    assert [(p["producer"], p["state"], p["seq"]) for p in listed] == [
        ("a", "open", "1.15"),
        ("b", "open", "1.15"),
    ], listed
    assert listed[0]["watermark"].startswith("2026-11-18T")
    code = cli(["global-producers", "--stream", unique_name, "--close", "a", "--server", url])
    assert code == 0 and "producer a of stream" in capsys.readouterr().err
    code = cli(["global-producers", "--stream", unique_name, "--close", "a", "--server", url])
    assert code == 0 and "was closed already" in capsys.readouterr().err
    code = cli(["global-producers", "--stream", unique_name, "--close", "zz", "--server", url])
    assert code == 2 and "registered: a, b" in capsys.readouterr().err
    assert cli(["global-producers", "--stream", unique_name, "--server", url]) == 0
    table = capsys.readouterr().out
    assert "closed by operator" in table and "open" in table, table


def test_global_read_watermarks_usage_errors(shared_nats_server, unique_name, capsys):
    url = shared_nats_server.url
    base = ["global-read", "--stream", unique_name, "--group", "g", "--handler", "x:f"]
    capsys.readouterr()
    assert cli([*base, "--watermarks", "--server", url]) == 2
    assert "pass --order-by event-time with it" in capsys.readouterr().err
    flags = ["--order-by", "event-time", "--watermarks", "--lateness", "3"]
    assert cli([*base, *flags, "--server", url]) == 2
    assert "--lateness applies to the window modes" in capsys.readouterr().err
    assert cli(["global-producers", "--stream", unique_name, "--close", "a.b"]) == 2
    assert "--close must be 1-64 letters" in capsys.readouterr().err


def test_global_read_watermarks_stops_at_a_plain_record_in_cli_terms(
    shared_nats_server, unique_name, tmp_path
):
    """A record published without GlobalProducer has no place in the exact order: the
    process stops before it (exit 3), naming partition, sequence and header, and the way
    out as a flag."""
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0

    async def plain() -> None:
        nc = await nats.connect(url)
        try:
            async with OrderedPublisher(nc, unique_name) as pub:
                await pub.publish("k", b"plain")
        finally:
            await nc.close()

    asyncio.run(plain())
    (tmp_path / "ledger.py").write_text(HANDLER)
    cmd = [sys.executable, "-m", "airflow_nats_ordered.cli", "global-read", "--stream"]
    cmd += [unique_name, "--group", "g", "--handler", "ledger:apply", "--server", url]
    cmd += ["--order-by", "event-time", "--watermarks"]
    env = dict(os.environ, GLOBAL_OUT=str(tmp_path / "out.txt"))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 3, proc.stderr
    assert "partition 0, stream sequence 1: header Nats-Ordered-Event-Time" in proc.stderr
    assert "read such a stream without --watermarks" in proc.stderr, proc.stderr
