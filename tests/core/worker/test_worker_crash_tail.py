"""What a SIGKILL re-delivers: the uncommitted tail of a busy member (issue 19 item 4).

A CLI worker process with a synchronous handler drains a backlog over eight partitions and
kills itself (SIGKILL) in the middle of it, from inside the handler, after holding the
event loop for a second (as a slow synchronous sink write does). Whatever the member had put
on the wire by then has reached the server; what it had not is lost with it. The test then
reads the group's commit records: everything applied after them is what a new owner
re-delivers.

A member's commit writes used to wait in the client for event-loop turns: a background
task created each write and nats-py's flusher task sent it, and on a busy loop those turns
come after every other partition's slice of handler work; and a partition went on handling
up to two commit periods past its last answered write. So each partition held one to three
periods that were not on the server (the old code re-delivered 250-400 messages here, with
``commit_every`` 50). Now a write is on the wire when it is submitted, and a synchronous
handler's partition gives the loop up at each commit point until the write is answered: a
crash re-delivers at most one period, of the partition in hand.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import defaultdict

import nats
from locations import TESTS

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

PARTITIONS = 8
N = 16000
KILL_AT = 4000
EVERY = 50


def test_a_sigkill_re_delivers_at_most_one_commit_period(shared_nats_server, unique_name, tmp_path):
    url = shared_nats_server.url
    apply_log = tmp_path / "applied"

    async def publish() -> None:
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(unique_name, partitions=PARTITIONS))
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(N):
                await pub.publish(f"k{i % 97}", b"%d" % i)
        await nc.close()

    asyncio.run(publish())
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p),
        CRASH_APPLY_LOG=str(apply_log),
        CRASH_AFTER=str(KILL_AT),
        CRASH_EACH=str(2 * EVERY),
        CRASH_PARTITIONS=str(PARTITIONS),
    )
    cmd = [sys.executable, "-m", "airflow_nats_ordered.cli", "worker"]
    cmd += ["--stream", unique_name, "--group", "g", "--member-id", "m1", "--server", url]
    cmd += ["--handler", "crash_handlers:KillAfter", "--lease-ttl", "10"]
    cmd += ["--commit-every", str(EVERY), "--commit-interval", "60"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])

    applied: dict[int, list[int]] = defaultdict(list)
    for line in apply_log.read_text().splitlines():
        p, seq = line.split()
        applied[int(p)].append(int(seq))
    assert sum(map(len, applied.values())) >= KILL_AT

    async def committed() -> dict[int, int]:
        nc = await nats.connect(url)
        store = await GroupStore.open(nc, GroupConfig(unique_name, "g", 10.0), create=False)
        out = {}
        for p in range(PARTITIONS):
            rec, _ = await store.read_commit(p)
            out[p] = rec.seq if rec is not None else 0
        await nc.close()
        return out

    positions = asyncio.run(committed())
    tail = {p: sum(1 for s in seqs if s > positions[p]) for p, seqs in applied.items()}
    assert all(len(applied[p]) >= 2 * EVERY for p in range(PARTITIONS)), applied.keys()
    assert sum(tail.values()) <= EVERY, (
        f"a SIGKILL re-delivers {sum(tail.values())} messages (per partition: {tail}; "
        f"commit records at {positions}), more than one commit period of {EVERY}"
    )
