"""Commit writes leave the hot path (issue 19 item 4).

A partition's position is written in the background, one write in flight, coalesced to the
latest position: an async handler goes on while a write waits for the server, up to two
commit periods ahead of the last write the server accepted (what a crash re-delivers), and
only then waits for it. Here the server is frozen (SIGSTOP) by the handler itself with
messages already buffered by the reader: before, the handler stopped at the next commit
point until the server answered (at most ``commit_every`` messages handled during the
freeze); now it handles what the bound allows (``2 * commit_every``) and the position is
still committed in order once the server is back (a freeze longer than the 1 s a partition
then waits only slows it down, as a failed write does).

A synchronous handler's partition waits for each write's answer instead (the other
partitions run meanwhile): see ``test_worker_crash_tail.py`` for why."""

from __future__ import annotations

import asyncio
import threading
import time

import nats

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

N = 1500
EVERY = 50
FREEZE_AT = 300
FREEZE_S = 0.8  # shorter than the 1 s a partition then waits for the write


def test_the_handler_goes_on_while_a_commit_waits_for_a_frozen_server(nats_server, unique_name):
    applied: list[tuple[int, float]] = []
    frozen: dict[str, float] = {}

    def thaw() -> None:
        time.sleep(FREEZE_S)
        frozen["thawed"] = time.monotonic()
        nats_server.resume()

    async def handle(msg):
        applied.append((msg.stream_seq, time.monotonic()))
        if len(applied) < FREEZE_AT:
            await asyncio.sleep(0.002)  # slow at first, so the reader has the rest buffered
        elif len(applied) == FREEZE_AT:
            nats_server.pause()
            frozen["at"] = time.monotonic()
            threading.Thread(target=thaw, daemon=True).start()

    async def go():
        nc = await nats.connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(N):
                await pub.publish("k", b"%d" % i)
        cfg = WorkerConfig(
            unique_name,
            "g",
            member_id="m1",
            lease_ttl=20.0,  # the freeze must not cost the lease
            fetch_batch=500,
            commit_every=EVERY,
            commit_interval=60.0,
        )
        w = Worker(nc, cfg, handle)
        await w.start()
        async with asyncio.timeout(120):
            while len(applied) < N:
                await asyncio.sleep(0.05)
        await w.stop()
        store = await GroupStore.open(nc, cfg.group_config)
        rec, _ = await store.read_commit(0)
        await nc.close()
        return rec

    rec = asyncio.run(go())
    during = [s for s, t in applied if frozen["at"] < t < frozen["thawed"]]
    assert len(during) > EVERY, (
        f"{len(during)} messages handled while the server was frozen: the handler waited "
        f"for a commit write (commit_every={EVERY})"
    )
    assert len(during) <= 2 * EVERY, (
        f"{len(during)} handled during the freeze: more than two commit periods uncommitted"
    )
    seqs = [s for s, _ in applied]
    assert seqs == sorted(seqs) and len(set(seqs)) == N, "out of order or re-delivered"
    assert rec is not None and rec.seq == seqs[-1], (rec, seqs[-1])
