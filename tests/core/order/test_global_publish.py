"""The publisher's global sequence and watermarks (issue 18 part 1): opt-in, publish order
over the whole stream, continued by the next publisher, and nothing changed without it."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from airflow_nats_ordered.core.errors import RecordError
from airflow_nats_ordered.core.order.sequencer import SEQUENCER_KEY, STALE_AFTER, SequencerBusy
from airflow_nats_ordered.core.order.watermarks import HDR_GLOBAL_SEQ, GlobalOrder
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.msg_ids import HDR_MSG_ID, derive_msg_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.operators.failures import unfixable


async def _stored(nc, stream: str) -> list[tuple[int, str, dict[str, str], bytes]]:
    """(stream seq, subject, headers, data) of every message, in stream order."""
    js = nc.jetstream()
    last = (await js.stream_info(stream)).state.last_seq
    out = []
    for seq in range(1, last + 1):
        m = await js.get_msg(stream, seq)
        out.append((seq, m.subject, dict(m.headers or {}), m.data or b""))
    return out


async def _watermarks(nc, stream: str, partitions: int) -> dict[int, int]:
    kv = await nc.jetstream().key_value(watermark_bucket(stream))
    return {p: json.loads((await kv.get(f"w.{p}")).value)["g"] for p in range(partitions)}


def test_global_sequence_is_publish_order_and_the_next_publisher_continues_it(
    nats_url, unique_name
):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=4))
            cfg = PublisherConfig(global_order=GlobalOrder(), producer_id="run-a")
            async with OrderedPublisher(nc, unique_name, cfg) as pub:
                # concurrent publish() calls: the sequence is still the acceptance order
                await asyncio.gather(*(pub.publish(f"k{i}", b"%d" % i) for i in range(40)))
            marks_a = await _watermarks(nc, unique_name, 4)
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub2:
                for i in range(40, 60):
                    await pub2.publish(f"k{i}", b"%d" % i)
            marks_b = await _watermarks(nc, unique_name, 4)
            return await _stored(nc, unique_name), marks_a, marks_b
        finally:
            await nc.close()

    stored, marks_a, marks_b = asyncio.run(go())
    by_g = sorted(stored, key=lambda s: int(s[2][HDR_GLOBAL_SEQ]))
    assert [int(s[3]) for s in by_g] == list(range(60))  # g order is publish order
    gs = [int(s[2][HDR_GLOBAL_SEQ]) for s in by_g]
    assert gs == list(range(1, 61))  # nothing refused or failed: no gaps either
    for subject in {s[1] for s in stored}:  # along each partition, g increases
        part = [int(s[2][HDR_GLOBAL_SEQ]) for s in stored if s[1] == subject]
        assert part == sorted(part)
    # after each flush every partition, busy or idle, is promised past everything sent
    assert marks_a == dict.fromkeys(range(4), 41)
    assert marks_b == dict.fromkeys(range(4), 61)
    # the stamp leaves the msg-id and the other headers as they were
    first = next(s for s in stored if s[3] == b"0")
    assert first[2][HDR_MSG_ID] == derive_msg_id("run-a", 1, "k0", b"0")


def test_without_global_order_the_header_block_is_unchanged_and_no_bucket_appears(
    nats_url, unique_name
):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, producer_id="plain") as pub:
                await pub.publish("a", b"x", headers={HDR_GLOBAL_SEQ: "7"})
            stored = await _stored(nc, unique_name)
            names = [n async for n in _bucket_names(nc)]
            return stored, names
        finally:
            await nc.close()

    stored, names = asyncio.run(go())
    [(_, _subject, headers, _)] = stored
    assert headers[HDR_MSG_ID] == derive_msg_id("plain", 1, "a", b"x")
    assert headers[HDR_GLOBAL_SEQ] == "7"  # an application's header, as before
    assert f"KV_{watermark_bucket(unique_name)}" not in names


async def _bucket_names(nc):
    for info in await nc.jetstream().streams_info():
        yield info.config.name


def test_a_caller_cannot_set_the_global_sequence_of_a_global_publisher(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                with pytest.raises(RecordError, match="(?i)nats-global-seq"):
                    await pub.publish("a", b"x", headers={"nats-global-seq": "1"})
                await pub.publish("a", b"y")
            return await _stored(nc, unique_name)
        finally:
            await nc.close()

    [(_, _, headers, data)] = asyncio.run(go())
    assert data == b"y" and headers[HDR_GLOBAL_SEQ] == "1"


def test_a_rerun_keeps_the_stored_records_sequence_and_numbers_new_ones_above_all(
    nats_url, unique_name
):
    """A rerun with the same producer id is de-duplicated by msg-id: the stored record keeps
    the global sequence it was stored with; the rerun's new records come after everything."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            for n in (3, 5):
                async with OrderedPublisher(
                    nc, unique_name, global_order=GlobalOrder(), producer_id="same"
                ) as pub:
                    for i in range(n):
                        await pub.publish("k", b"%d" % i)
            return await _stored(nc, unique_name)
        finally:
            await nc.close()

    stored = asyncio.run(go())
    assert [(s[3], s[2][HDR_GLOBAL_SEQ]) for s in stored] == [
        (b"0", "1"),
        (b"1", "2"),
        (b"2", "3"),
        (b"3", "7"),  # the rerun started at 4; its first three were duplicates
        (b"4", "8"),
    ]


def test_one_global_order_publisher_at_a_time_and_an_abandoned_claim_is_taken_over(
    nats_url, unique_name
):
    """Two global-order publishers at once would number from the same base: the second is
    refused (SequencerBusy, naming the first) until the first closes. A claim whose holder
    died (not renewed for STALE_AFTER seconds) is taken over."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            first = OrderedPublisher(
                nc, unique_name, global_order=GlobalOrder(), producer_id="first"
            )
            await first.start()
            with pytest.raises(SequencerBusy, match="'first'") as busy:
                await OrderedPublisher(nc, unique_name, global_order=GlobalOrder()).start()
            # it passes (the holder closes or its claim lapses): an Airflow task retries it
            assert not unfixable(busy.value)
            await first.publish("a", b"1")
            await first.close()
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as second:
                await second.publish("a", b"2")
            # a holder that died: its last renewal is older than STALE_AFTER
            kv = await nc.jetstream().key_value(watermark_bucket(unique_name))
            old = time.time() - STALE_AFTER - 1
            await kv.put(SEQUENCER_KEY, json.dumps({"producer": "dead", "ts": old}).encode())
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as third:
                await third.publish("a", b"3")
            return await _stored(nc, unique_name)
        finally:
            await nc.close()

    stored = asyncio.run(go())
    assert [(s[3], s[2][HDR_GLOBAL_SEQ]) for s in stored] == [(b"1", "1"), (b"2", "2"), (b"3", "3")]
