"""Msg-id de-duplication must never drop a record the publisher reports as acknowledged.

Issue 7, items 1-2: positions taken atomically with acceptance, a unique producer id by
default, duplicates the publisher did not expect reported (not counted as stored), and a
stream whose duplicate window is shorter than the publisher's resend horizon refused.
The records are deliberately repeated payloads (``{"op":"incr"}``): only the position
and the producer id tell them apart.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from streamcheck import read_stream

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.msg_ids import HDR_MSG_ID, HDR_SEQ, derive_msg_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for

INCR = b'{"op":"incr"}'


def test_concurrent_publishes_take_distinct_positions(nats_url, unique_name):
    """Three gathered publish() calls with max_pending=1 used to take the same position,
    hence the same msg-id: 3 acknowledged, 2 stored, nothing raised."""

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        async with OrderedPublisher(nc, unique_name, max_pending=1) as pub:
            await asyncio.gather(*(pub.publish("k", INCR) for _ in range(3)))
        stored = await read_stream(nc, unique_name)
        seqs = []
        sub = await nc.jetstream().pull_subscribe(">", stream=unique_name)
        for m in await sub.fetch(3, timeout=5):
            seqs.append(m.headers[HDR_SEQ])
        await nc.close()
        return pub.summary, stored, seqs

    summary, stored, seqs = asyncio.run(go())
    assert summary.accepted == summary.acked == 3
    assert len(stored) == 3, f"acknowledged 3 records but stored {len(stored)}"
    assert sorted(seqs) == ["1", "2", "3"]
    assert len({s.msg_id for s in stored}) == 3


def test_publishers_without_producer_id_never_share_msg_ids(nats_url, unique_name):
    """Two unrelated publishers (two jobs) publishing the same records at the same
    positions: each one's records are stored, none is taken for the other's duplicate."""
    records = [(f"acct-{i % 3}", INCR) for i in range(30)]

    async def one(nc) -> OrderedPublisher:
        async with OrderedPublisher(nc, unique_name) as pub:
            for k, body in records:
                await pub.publish(k, body)
        return pub

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        first, second = await one(nc), await one(nc)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return first, second, stored

    first, second, stored = asyncio.run(go())
    assert first.producer_id != second.producer_id
    assert first.producer_id.startswith("pub-")
    assert second.summary.duplicates == 0
    assert len(stored) == 2 * len(records)


def test_duplicate_the_publisher_did_not_expect_is_reported_not_counted_stored(
    nats_url, unique_name
):
    """Another writer already stored the msg-id of this publisher's 2nd record (same
    producer id, same place in the input): the server acknowledges the record without storing it.
    That record is lost unless reported: flush() must raise and name the cause."""

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        pub = OrderedPublisher(nc, unique_name)
        p = partition_for("k", 2)
        # the other writer, earlier inside the duplicate window: same producer id, so the
        # same derived msg-id for the input's 2nd record
        foreign = derive_msg_id(pub.producer_id, 2, "k", INCR)
        await nc.jetstream().publish(
            f"{unique_name.lower()}.p.{p}", b"other", headers={HDR_MSG_ID: foreign}
        )
        await pub.start()
        for _ in range(3):
            await pub.publish("k", INCR)
        with pytest.raises(PublishError) as exc_info:
            await pub.flush()
        await pub.close(raise_on_failure=False)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return exc_info.value, stored

    error, stored = asyncio.run(go())
    s = error.summary
    assert s.acked == 3 and s.failed == 0
    assert s.unexpected_duplicates == 1 and s.duplicates == 1
    assert sum(p.stored for p in s.partitions) == 2
    assert s.to_dict()["unexpected_duplicates"] == 1
    msg = str(error)
    assert "1 acknowledged records were NOT stored" in msg
    assert "same producer id or msg-ids inside the stream's duplicate window" in msg
    assert len(stored) == 3  # the foreign record and two of ours


def test_rerun_with_the_same_producer_id_reports_duplicates_not_failures(nats_url, unique_name):
    """A deliberate rerun (explicit, stable producer id) expects every record to be a
    duplicate: counted as duplicates, no error."""
    records = [("k", INCR)] * 5 + [("j", INCR)] * 5

    async def run_once(nc):
        async with OrderedPublisher(nc, unique_name, producer_id="run-7") as pub:
            for k, body in records:
                await pub.publish(k, body)
        return pub.summary

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        first = await run_once(nc)
        again = await run_once(nc)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return first, again, stored

    first, again, stored = asyncio.run(go())
    assert first.duplicates == 0 and sum(p.stored for p in first.partitions) == 10
    assert again.acked == 10 and again.duplicates == 10 and again.unexpected_duplicates == 0
    assert len(stored) == 10


def test_start_refuses_a_duplicate_window_shorter_than_the_resend_horizon(nats_url, unique_name):
    """A resend later than the stream's duplicate window is stored again, after records
    already stored (reordering): start() refuses and says which number to raise."""

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2, duplicate_window=60))
        with pytest.raises(ConfigError) as exc_info:
            await OrderedPublisher(nc, unique_name).start()  # delivery_timeout 120 s
        # a publisher whose resends all fall inside the window is fine
        async with OrderedPublisher(nc, unique_name, delivery_timeout=50, ack_timeout=5) as ok:
            await ok.publish("k", INCR)
        await nc.close()
        return str(exc_info.value), ok.summary

    msg, summary = asyncio.run(go())
    assert f"stream {unique_name} de-duplicates msg-ids for 60s (duplicate_window)" in msg
    assert "up to 126s after sending it (delivery_timeout 120s + ack_timeout 5s" in msg
    assert f"nats-ordered provision --stream {unique_name}" in msg
    assert "--duplicate-window 126s" in msg
    assert "lower the publisher's delivery_timeout to at most 54s" in msg
    assert summary.acked == 1


def test_resend_after_the_duplicate_window_is_stored_again_out_of_order(
    nats_url, unique_name, monkeypatch
):
    """Why start() refuses a short window: the risk is real. With the check bypassed and
    a 1 s window, every acknowledgement but the one that opens a batch is lost for 3 s,
    so the publisher resends records the server stored more than a window ago: they are
    stored again, after the later records (r1 after r5)."""
    records = [("k", b"r%d" % i) for i in range(1, 6)]

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1, duplicate_window=1.0))
        monkeypatch.setattr(PublisherConfig, "longest_resend", 0.0)  # bypass start()'s check
        pub = OrderedPublisher(nc, unique_name, ack_timeout=0.5, delivery_timeout=30)
        real_on_reply = pub._on_reply
        loop = asyncio.get_running_loop()
        deaf_until = loop.time() + 3.0

        async def lossy_on_reply(msg) -> None:
            if loop.time() >= deaf_until or b'"type":"ack","seq":0,' in msg.data:
                await real_on_reply(msg)

        pub._on_reply = lossy_on_reply  # type: ignore[method-assign]
        await pub.start()
        for k, body in records:
            await pub.publish(k, body)
        await pub.close(raise_on_failure=False)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return [s.data for s in stored]

    stored = asyncio.run(go())
    assert stored[:6] == [b"r1", b"r2", b"r3", b"r4", b"r5", b"r1"], f"stored {stored}"
