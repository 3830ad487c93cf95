"""What a member reports about itself (the figures its metrics endpoint serves)."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


def test_member_counts_handler_errors_rebalances_and_times_its_renewals(nats_url, unique_name):
    failed_once: set[int] = set()

    def handler(msg):
        i = json.loads(msg.data)["i"]
        if i % 10 == 0 and i not in failed_once:
            failed_once.add(i)
            raise RuntimeError("transient")

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        cfg = WorkerConfig(unique_name, "g", member_id="s", lease_ttl=1.0, retry_backoff=0.01)
        async with WorkerPool(nats_url, cfg, handler, size=1) as pool:
            await pool.wait_assigned(10)
            first = pool.workers[0]
            async with OrderedPublisher(nc, unique_name) as pub:
                for i in range(50):
                    await pub.publish(f"k{i}", json.dumps({"i": i}).encode())
            await wait_drained(nc, unique_name, "g", timeout=20)
            await pool.add()
            await pool.wait_assigned(10)
            await asyncio.sleep(0.6)  # a few renewal rounds
            stats, renew, beat = dict(first.stats), first.renew_seconds, first.last_heartbeat
        await nc.close()
        return stats, renew, beat

    stats, renew, beat = asyncio.run(go())
    assert stats["handler_errors"] == 5 and stats["retries"] == 5
    assert stats["rebalances"] == 2  # its first assignment, then the join that took a share
    assert 0 < renew < 1.0 and beat > 0


def test_stop_ends_within_stop_timeout_even_with_a_handler_stuck_in_io(nats_url, unique_name):
    stuck = asyncio.Event()

    async def handler(msg):
        stuck.set()
        await asyncio.sleep(3600)  # an I/O call that never returns

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        cfg = WorkerConfig(unique_name, "g", member_id="x", lease_ttl=1.0, stop_timeout=1.0)
        pool = WorkerPool(nats_url, cfg, handler, size=1)
        await pool.start()
        async with OrderedPublisher(nc, unique_name) as pub:
            await pub.publish("k", b"{}")
        await asyncio.wait_for(stuck.wait(), 10)
        # the handler is stuck for an hour: a stop() that ignored stop_timeout (1 s) would
        # wait for it; 120 s is a bound on that hang, not a speed
        await asyncio.wait_for(pool.stop(), 120)
        await nc.close()

    asyncio.run(go())
