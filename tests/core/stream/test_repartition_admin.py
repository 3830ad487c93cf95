"""Group administration across a repartition (issue 18 part 2): a reset of a group that has
not finished the old layout works on the old layout's partitions (their subjects, their
commit records), and skipping them to the end lets the group move to the new layout."""

from __future__ import annotations

import asyncio
import time

import nats

from airflow_nats_ordered.core.admin.drain import read_lag
from airflow_nats_ordered.core.admin.reset import plan_reset, reset_group
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker


def test_a_reset_before_the_switch_is_a_reset_of_the_old_layout(shared_nats_server, unique_name):
    url, stream = shared_nats_server.url, unique_name
    handled: list[str] = []

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        cfg = WorkerConfig(stream, "g", member_id="w1", lease_ttl=2.0)
        w = Worker(nc, cfg, lambda m: None)
        await w.start()
        await w.wait_assigned(60)
        await w.stop()
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(40):
                await pub.publish(f"k{i % 8}", b"old")
        await repartition(nc, stream, 8)
        plan = await plan_reset(nc, stream, "g", to="latest")
        # the old layout's 4 partitions, ending at their last records, none past the switch
        assert sorted(p.partition for p in plan.partitions) == [0, 1, 2, 3]
        assert sum(p.messages for p in plan.partitions) == 40
        assert all(p.target == p.last <= 40 for p in plan.partitions)
        await reset_group(nc, stream, "g", to="latest", confirm=True)
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(16):
                await pub.publish(f"k{i % 8}", b"new")
        w = Worker(nc, cfg, lambda m: handled.append(m.data.decode()))
        await w.start()
        deadline = time.monotonic() + 60
        while len(handled) < 16:
            assert time.monotonic() < deadline, handled
            await asyncio.sleep(0.1)
        # the skipped old records were not handled; the group moved and drains
        assert handled == ["new"] * 16
        while not (lag := await read_lag(nc, stream, "g")).drained:
            assert time.monotonic() < deadline, lag
            await asyncio.sleep(0.1)
        assert lag.epoch == 1
        await w.stop()
        await nc.close()

    asyncio.run(main())
