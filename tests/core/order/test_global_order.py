"""The global-order reader (issue 18 part 1) against the real shared nats-server: partitions
merged into one exact order by global sequence, idle partitions advanced by watermarks,
a crash mid-merge resumed from the durable position, and bounded buffers."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.global_position import POSITION_KEY
from airflow_nats_ordered.core.order.merge import GlobalOrderViolation
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.order.watermarks import HDR_GLOBAL_SEQ, GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

WAIT = 60.0


async def _until(cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _keys_on(partitions: set[int], n: int, total: int) -> list[str]:
    """n keys, round-robin over ``partitions`` of a stream of ``total`` partitions."""
    by_part: dict[int, list[str]] = {p: [] for p in partitions}
    i = 0
    while min(len(v) for v in by_part.values()) < n:
        k = f"key-{i}"
        p = partition_for(k, total)
        if p in by_part:
            by_part[p].append(k)
        i += 1
    order = sorted(partitions)
    return [by_part[order[j % len(order)]][j // len(order)] for j in range(n)]


def test_live_records_come_out_in_publish_order_with_an_idle_partition_advanced(
    nats_url, unique_name
):
    """The reader runs while records are published to partitions 0-2 with pauses; partition
    3 gets none, so only its watermarks let the merge hand anything over past its bound."""
    keys = _keys_on({0, 1, 2}, 90, 4)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=4))
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(nc, unique_name, "ledger", got.append)
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                await reader.start()
                for i, k in enumerate(keys):
                    await pub.publish(k, b"%d" % i)
                    if i % 30 == 29:
                        await pub.flush()  # lanes go idle between bursts
            await _until(lambda: len(got) == len(keys), "every record")
            await reader.stop()
            return got, reader.stats
        finally:
            await nc.close()

    got, stats = asyncio.run(go())
    assert [int(m.data) for m in got] == list(range(90))  # one order: publish order
    assert [m.global_seq for m in got] == sorted({m.global_seq for m in got})
    assert {m.partition for m in got} == {0, 1, 2}
    assert [m.key for m in got] == keys
    assert stats.watermark_advances > 0  # partition 3 advanced by watermarks only


def test_records_arriving_out_of_order_across_partitions_are_released_exactly(
    nats_url, unique_name
):
    """A producer following docs/protocol.md section 12 by hand: partition 0's records
    (2, 4, 6) are stored and read before partition 1's (1, 3, 5); partition 2 has nothing
    until its watermark. The reader hands nothing over before it is known to be next."""

    async def go():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        try:
            stream = await provision(nc, StreamSpec(unique_name, partitions=3))
            subj = stream.stream.subject
            kv = await js.create_key_value(bucket=watermark_bucket(unique_name), history=1)

            async def put(p: int, g: int) -> int:
                ack = await js.publish(
                    subj(p), b"%d" % g, headers={HDR_GLOBAL_SEQ: str(g), "Nats-Msg-Id": f"g{g}"}
                )
                return ack.seq

            got: list[int] = []
            reader = GlobalOrderReader(nc, unique_name, "audit", lambda m: got.append(m.global_seq))
            await reader.start()
            last0 = [await put(0, g) for g in (2, 4, 6)][-1]
            readers = reader._readers  # test-only look inside: wait until read, not a time
            await _until(lambda: readers[0].next_seq > last0, "partition 0 read")
            assert got == []  # 1 may still come on partition 1 or 2
            last1 = [await put(1, g) for g in (1, 3, 5)][-1]
            await _until(lambda: readers[1].next_seq > last1, "partition 1 read")
            await _until(lambda: got == [1], "global sequence 1")
            assert got == [1]  # 2 waits: partition 2 may still bring it
            await kv.put("w.2", json.dumps({"g": 7}).encode())
            await _until(lambda: len(got) == 6, "the rest after partition 2's watermark")
            await reader.stop()
            return got, reader.stats.watermark_advances
        finally:
            await nc.close()

    got, advances = asyncio.run(go())
    assert got == [1, 2, 3, 4, 5, 6]
    assert advances >= 1


def test_a_crash_mid_merge_resumes_after_the_durable_position_in_the_same_order(
    nats_url, unique_name
):
    """Reader A is cancelled (a crash: no final write) while its handler holds record 70;
    it wrote its position every 25 records. Reader B, a new process' worth of state (a new
    connection), resumes after 50: records 51.. again, in the same order, nothing lost."""
    keys = _keys_on({0, 1, 2}, 120, 3)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                for i, k in enumerate(keys):
                    await pub.publish(k, b"%d" % i)
            first: list[int] = []
            forever = asyncio.Event()

            async def handle_a(m: GlobalMessage) -> None:
                first.append(m.global_seq)
                if len(first) == 70:
                    await forever.wait()  # the crash happens with this record in hand

            a = GlobalOrderReader(nc, unique_name, "g", handle_a, commit_every=25)
            task = asyncio.ensure_future(a.run())
            await _until(lambda: len(first) == 70, "70 records in reader A")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await nc.close()
        nc = await nats.connect(nats_url)
        try:
            second: list[int] = []
            b = GlobalOrderReader(nc, unique_name, "g", lambda m: second.append(m.global_seq))
            await b.start()
            await _until(lambda: second and second[-1] == 120, "reader B to the end")
            await b.stop()
            state = await nc.jetstream().key_value(f"nor_{unique_name}_g_state")
            pos = json.loads((await state.get(POSITION_KEY)).value)
            return first, second, pos
        finally:
            await nc.close()

    first, second, pos = asyncio.run(go())
    assert first == list(range(1, 71))
    assert second == list(range(51, 121))  # after the last written position, in order
    delivered = sorted(set(first) | set(second))
    assert delivered == list(range(1, 121))  # nothing lost
    assert pos["g"] == 120 and sum(1 for _ in pos["seqs"]) == 3


def test_small_buffers_still_deliver_everything_in_order(nats_url, unique_name):
    """max_buffer_bytes far below the data: each partition holds about one record at a
    time, read again only after the merge takes it (back-pressure per partition)."""
    keys = _keys_on({0, 1, 2, 3}, 60, 4)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=4))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                for i, k in enumerate(keys):
                    await pub.publish(k, b"%04d" % i + b"x" * 700)
            got: list[int] = []
            most = [0]

            def handle(m: GlobalMessage) -> None:
                got.append(int(m.data[:4]))
                most[0] = max(most[0], reader._strategy.merge.buffered_bytes())

            reader = GlobalOrderReader(
                nc, unique_name, "small", handle, max_buffer_bytes=4096, fetch_batch=10
            )
            await reader.start()
            await _until(lambda: len(got) == 60, "every record")
            await reader.stop()
            return got, most[0]
        finally:
            await nc.close()

    got, most = asyncio.run(go())
    assert got == list(range(60))
    assert most <= 4 * 2 * 1000  # at most about one record per partition was held


def test_a_record_without_a_global_sequence_stops_the_reader_before_it(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                await pub.publish("a", b"stamped")
            async with OrderedPublisher(nc, unique_name) as plain:
                await plain.publish("a", b"plain")
            got: list[bytes] = []
            reader = GlobalOrderReader(nc, unique_name, "g", lambda m: got.append(m.data))
            await reader.start()
            with pytest.raises(GlobalOrderViolation, match=r"global_order=GlobalOrder\(\)"):
                await asyncio.wait_for(reader.wait(), WAIT)
            return got
        finally:
            await nc.close()

    assert asyncio.run(go()) in ([], [b"stamped"])  # never the unstamped record


def test_a_second_reader_of_the_group_fences_the_first(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                await pub.publish("a", b"1")
            got: list[int] = []
            a = GlobalOrderReader(nc, unique_name, "g", lambda m: got.append(m.fencing_token))
            await a.start()
            await _until(lambda: len(got) == 1, "reader A's record")
            b = GlobalOrderReader(nc, unique_name, "g", lambda m: None, member_id="b")
            await b.open()  # takes the position with a newer token
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                await pub.publish("a", b"2")
            with pytest.raises(Fenced):
                await asyncio.wait_for(a.wait(), WAIT)
            return got, b._positions.current.token
        finally:
            await nc.close()

    got, token_b = asyncio.run(go())
    assert got[0] < token_b


def test_a_group_of_per_key_workers_is_refused_with_the_fix(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                await pub.publish("a", b"1")
            w = Worker(nc, WorkerConfig(unique_name, "billing", lease_ttl=2.0), lambda m: None)
            await w.start()
            try:
                await w.wait_assigned(WAIT)
            finally:
                await w.stop()
            reader = GlobalOrderReader(nc, unique_name, "billing", lambda m: None)
            with pytest.raises(ConfigError, match="another group name"):
                await reader.start()
        finally:
            await nc.close()

    asyncio.run(go())
