"""A record on a partition its key does not hash to (a foreign producer's mistake) is never
handed to the handler: it follows the poison policy (dead-lettered with the reason, or the
partition blocks and says why), so a key's records are never applied out of order in silence.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats

from airflow_nats_ordered.core.admin.dlq import dead_letters
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for, partition_subject
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR
from airflow_nats_ordered.core.worker.worker import Worker

P = 4


def _key_of(partition: int, prefix: str) -> str:
    return next(
        k for k in (f"{prefix}{i}" for i in range(1000)) if partition_for(k, P) == partition
    )


async def _until(cond, timeout=45.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _scenario(url: str, stream: str, poison: str):
    """Key ``k`` (partition 2) gets records 1, 2, then 3 misrouted to partition 3 by a foreign
    client, then 4; key ``l`` (partition 3) gets a record after the misrouted one."""
    k, other = _key_of(2, "k"), _key_of(3, "l")
    seen: list[tuple[str, int, int]] = []  # (key, i, partition)

    def handler(msg):
        seen.append((msg.key, json.loads(msg.data)["i"], msg.partition))

    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=P))
    async with OrderedPublisher(nc, stream) as pub:
        for i in (1, 2):
            await pub.publish(k, json.dumps({"i": i}).encode())
    # the foreign client: a raw publish on partition 3's subject with k's key header
    await nc.jetstream().publish(
        partition_subject(stream.lower(), 3),
        json.dumps({"i": 3}).encode(),
        headers={"Nats-Ordered-Key": k},
    )
    async with OrderedPublisher(nc, stream) as pub:
        await pub.publish(k, json.dumps({"i": 4}).encode())
        await pub.publish(other, json.dumps({"i": 1}).encode())
    cfg = WorkerConfig(
        stream, "g", member_id="m1", lease_ttl=2.0, poison=poison, retry_backoff=0.01
    )
    w = Worker(nc, cfg, handler)
    await w.start()
    return nc, w, k, other, seen


def test_a_misrouted_record_is_dead_lettered_with_the_reason_not_handled(nats_url, unique_name):
    async def go():
        nc, w, k, other, seen = await _scenario(nats_url, unique_name, "dead-letter")
        await _until(lambda: w.stats["dead_lettered"] >= 1 and (other, 1, 3) in seen)
        await _until(lambda: (k, 4, 2) in seen)
        await w.stop()
        counted = await dead_letters(nc, unique_name, "g")
        sub = await nc.jetstream().pull_subscribe(">", stream=f"{unique_name}_DLQ")
        dead = await sub.fetch(1, timeout=10)
        await nc.close()
        return k, seen, counted, dead, w.stats

    k, seen, counted, dead, stats = asyncio.run(go())
    assert [i for key, i, _ in seen if key == k] == [1, 2, 4], seen  # 3 never handed over
    assert stats["dead_lettered"] == 1 and stats["rejected"] == 1
    assert counted.messages == 1  # what `status` shows as the group's dead letters
    assert json.loads(dead[0].data) == {"i": 3}
    assert (
        f"misrouted: key {k!r} hashes to partition 2, found on partition 3"
        in dead[0].headers[HDR_ERROR]
    )


def test_a_misrouted_record_blocks_the_partition_under_the_block_policy(nats_url, unique_name):
    async def go():
        nc, w, k, other, seen = await _scenario(nats_url, unique_name, "block")
        await _until(lambda: (k, 4, 2) in seen and 3 in w.owned and w.owned[3].blocked)
        await asyncio.sleep(0.5)  # nothing after the misrouted record is handled meanwhile
        snap = await w.store.snapshot()
        await w.stop()
        await nc.close()
        return k, other, seen, snap

    k, other, seen, snap = asyncio.run(go())
    assert [i for key, i, _ in seen if key == k] == [1, 2, 4], seen
    assert (other, 1, 3) not in seen  # partition 3 stops at the misrouted record
    assert list(snap.blocked) == [3]
    reason = snap.blocked[3]
    assert f"misrouted: key {k!r} hashes to partition 2, found on partition 3" in reason, reason
    assert "not handed to the handler" in reason


def test_a_batch_is_cut_before_a_misrouted_record(nats_url, unique_name):
    """Batch mode: the records before and after the misrouted one reach the batch handler,
    the misrouted one never does."""
    k, other = _key_of(2, "k"), _key_of(3, "l")
    batches: list[list[tuple[str, int]]] = []

    def handler(batch):
        batches.append([(m.key, json.loads(m.data)["i"]) for m in batch])

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=P))
        subject = partition_subject(unique_name.lower(), 3)
        async with OrderedPublisher(nc, unique_name) as pub:
            await pub.publish(other, json.dumps({"i": 1}).encode())
            await pub.flush()
            await nc.jetstream().publish(
                subject, json.dumps({"i": 2}).encode(), headers={"Nats-Ordered-Key": k}
            )
            await pub.publish(other, json.dumps({"i": 3}).encode())
        cfg = WorkerConfig(unique_name, "g", member_id="m1", lease_ttl=2.0, batch_handler=True)
        w = Worker(nc, cfg, handler)
        await w.start()
        await _until(lambda: w.stats["dead_lettered"] >= 1 and w.stats["processed"] >= 2)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    handled = [r for b in batches for r in b]
    assert handled == [(other, 1), (other, 3)], batches
