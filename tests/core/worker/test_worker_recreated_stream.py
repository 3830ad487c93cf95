"""A running member whose stream is deleted and created again under the same name stops
instead of reading the new stream from the old positions (which would skip messages
silently)."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


async def _publish(nc, stream: str, start: int, n: int) -> None:
    async with OrderedPublisher(nc, stream) as pub:
        for i in range(start, start + n):
            await pub.publish("k", json.dumps({"i": i}).encode())


def test_a_running_member_stops_rather_than_reading_a_recreated_stream(nats_url, unique_name):
    seen: list[int] = []

    async def handler(msg):
        seen.append(json.loads(msg.data)["i"])

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        await _publish(nc, unique_name, 0, 10)
        cfg = WorkerConfig(unique_name, "g", member_id="m", lease_ttl=2.0, commit_interval=0.1)
        async with WorkerPool(nats_url, cfg, handler, size=1):
            for _ in range(100):
                if len(seen) >= 10:
                    break
                await asyncio.sleep(0.05)
            await nc.jetstream().delete_stream(unique_name)
            await provision(nc, StreamSpec(unique_name, partitions=1))
            await _publish(nc, unique_name, 100, 15)
            await asyncio.sleep(10)  # the reader notices its consumer is gone (<= ~7 s)
            store = await GroupStore.attach(nc, unique_name, "g")
            problems = (await store.snapshot()).problems
        await nc.close()
        return problems

    problems = asyncio.run(go())
    assert seen == list(range(10)), f"read the new stream from the old position: {seen[10:]}"
    assert any("deleted and created again" in p for p in problems)


def test_a_deleted_stream_stops_the_partition_cleanly_and_is_reported(nats_url, unique_name):
    async def handler(msg):
        pass

    async def go():
        loop = asyncio.get_running_loop()
        unhandled: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        await _publish(nc, unique_name, 0, 5)
        cfg = WorkerConfig(unique_name, "g", member_id="d", lease_ttl=2.0, commit_interval=0.1)
        async with WorkerPool(nats_url, cfg, handler, size=1) as pool:
            await pool.wait_assigned(10)
            await nc.jetstream().delete_stream(unique_name)
            await asyncio.sleep(9)  # the reader notices its consumer is gone
            problems = dict(pool.workers[0].problems)
            # every partition task that ended, ended cleanly (none died with the error)
            ended = [t for t in pool.workers[0].reconciler.previous.values() if t.done()]
            crashed = [repr(t.exception()) for t in ended if t.exception() is not None]
        await nc.close()
        return unhandled, problems, crashed

    unhandled, problems, crashed = asyncio.run(go())
    assert not crashed and not [c for c in unhandled if "exception" in c], crashed or unhandled
    assert any("does not exist" in p for p in problems.values()), problems
