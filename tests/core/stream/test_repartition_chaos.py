"""Repartitioning 8 -> 3 while a publisher publishes and ``nats-ordered worker`` processes
apply every record through the reference fenced sink, with a member SIGKILLed during the
switch (issue 18 part 2): every key's records applied in order, none lost, none twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import nats
from chaos_handlers import EVENTS_DDL
from locations import TESTS

from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition

GROUP = "rp"
KEYS = 10
ROUNDS = 20
SWITCH_AFTER = 15  # rounds 0-15 mostly on the old layout, the rest on the new one


def _start(url: str, stream: str, member: str, tmp: Path, sink: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        CHAOS_SINK=str(sink),
        CHAOS_MEMBER=member,
        CHAOS_DELAY="0.2",  # far slower than the publisher: a backlog at the switch
    )
    log = open(tmp / f"{member}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "airflow_nats_ordered.cli",
            "worker",
            "-v",
            "--stream",
            stream,
            "--group",
            GROUP,
            "--handler",
            "chaos_handlers:Recorder",
            "--member-id",
            member,
            "--lease-ttl",
            "2",
            "--server",
            url,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _events(sink: Path) -> list[tuple[str, int, int, int]]:
    if not sink.exists():
        return []
    with sqlite3.connect(sink, timeout=30) as db:
        try:
            return db.execute("SELECT k, i, partition, seq FROM events ORDER BY id").fetchall()
        except sqlite3.OperationalError:  # the table is not there yet
            return []


def test_8_to_3_with_a_member_killed_during_the_switch(shared_nats_server, unique_name, tmp_path):
    url, stream = shared_nats_server.url, unique_name
    sink = tmp_path / "sink.db"
    procs: dict[str, subprocess.Popen] = {}
    state: dict[str, object] = {}

    with sqlite3.connect(sink) as db:
        db.execute(EVENTS_DDL)

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=8, storage="memory"))
        for m in ("w1", "w2"):
            procs[m] = _start(url, stream, m, tmp_path, sink)
        halfway = asyncio.Event()

        async def publish():
            cfg = PublisherConfig(ack_timeout=1.0, delivery_timeout=1.0)
            for r in range(ROUNDS):
                while True:  # refused by the switch: publish the round again, same msg-ids
                    try:
                        async with OrderedPublisher(nc, stream, config=cfg) as pub:
                            for k in range(KEYS):
                                body = json.dumps({"k": f"k{k}", "i": r}).encode()
                                await pub.publish(f"k{k}", body, msg_id=f"k{k}-{r}")
                        break
                    except PublishError:
                        pass
                while r == 0 and not _events(sink):  # the members are up and applying
                    await asyncio.sleep(0.1)
                if r == SWITCH_AFTER:
                    halfway.set()
                await asyncio.sleep(0.05)

        task = asyncio.ensure_future(publish())
        await halfway.wait()
        # the workers are still busy with the old layout (200 ms a record): kill one of them
        # right after the switch, while the group finishes the old partitions
        state["result"] = await repartition(nc, stream, 3)
        procs["w1"].send_signal(signal.SIGKILL)
        procs["w1"].wait(timeout=60)
        state["applied_at_kill"] = len(_events(sink))
        procs["w3"] = _start(url, stream, "w3", tmp_path, sink)
        await task
        await nc.close()

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 120
        while len(_events(sink)) < ROUNDS * KEYS and time.monotonic() < deadline:
            assert any(p.poll() is None for p in procs.values()), "every worker exited"
            time.sleep(0.2)
        events = _events(sink)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    logs = "\n".join((tmp_path / f"{m}.log").read_text()[-3000:] for m in procs)
    per_key: dict[str, list[int]] = {}
    for k, i, _p, _seq in events:
        per_key.setdefault(k, []).append(i)
    # the fenced sink applies each record once: every key exactly 0, 1, ..., in order
    for k in range(KEYS):
        assert per_key.get(f"k{k}") == list(range(ROUNDS)), (f"k{k}", per_key.get(f"k{k}"), logs)
    assert len(events) == ROUNDS * KEYS
    result = state["result"]
    old = [e for e in events if e[3] <= result.switch_seq]  # type: ignore[attr-defined]
    new = [e for e in events if e[3] > result.switch_seq]  # type: ignore[attr-defined]
    assert old and new and max(e[2] for e in new) <= 2
    # the kill came during the switch: the old layout's records were not all applied yet
    assert 0 < state["applied_at_kill"] < len(old)  # type: ignore[operator]
    # every old-layout record was applied before the first new-layout one
    assert events.index(new[0]) == len(old)
