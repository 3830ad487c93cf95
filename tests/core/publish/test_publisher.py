"""The ordered publisher against a real server: order, exactly-once, refusals, bounds."""

from __future__ import annotations

import asyncio

import nats
import pytest
from streamcheck import check_stored, make_records, read_stream

from airflow_nats_ordered.core.errors import (
    ConfigError,
    MissingKeyError,
    PartitionMismatchError,
    RecordError,
    RecordTooLargeError,
)
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.msg_ids import (
    HDR_MSG_ID,
    HDR_PRODUCER,
    HDR_SEQ,
    derive_msg_id,
)
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.keys import HDR_KEY
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for


async def _publish_all(nc, stream, records, **knobs):
    async with OrderedPublisher(nc, stream, **knobs) as pub:
        for k, body in records:
            await pub.publish(k, body)
    return pub.summary


def test_every_record_stored_once_in_per_key_order(shared_nats_server, unique_name):
    records = make_records(20_000, keys=300)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=16))
        summary = await _publish_all(nc, unique_name, records)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, stored

    summary, stored = asyncio.run(go())
    assert summary.acked == summary.accepted == len(records)
    assert summary.failed == 0 and summary.duplicates == 0
    counts = check_stored(records, stored, 16, unique_name.lower())
    assert sum(counts.values()) == len(records)
    # the high-water mark of each partition is the sequence of its last stored record
    last = {}
    for s in stored:
        last[int(s.subject.rsplit(".", 1)[1])] = s.seq
    assert summary.high_water_marks == {p: last.get(p, 0) for p in range(16)}


def test_rerun_of_same_input_stores_nothing_twice(shared_nats_server, unique_name):
    records = make_records(5_000, keys=50)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        first = await _publish_all(nc, unique_name, records, producer_id="run-1")
        again = await _publish_all(nc, unique_name, records, producer_id="run-1")
        other = await _publish_all(nc, unique_name, records[:10], producer_id="run-2")
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return first, again, other, stored

    first, again, other, stored = asyncio.run(go())
    assert first.duplicates == 0
    assert again.acked == len(records) and again.duplicates == len(records)
    assert sum(p.stored for p in again.partitions) == 0
    # the rerun's high-water marks still point at the stored records
    assert again.high_water_marks == first.high_water_marks
    # a different producer id is a different run: its records are new
    assert other.duplicates == 0 and sum(p.stored for p in other.partitions) == 10
    assert len(stored) == len(records) + 10


def test_headers_carry_key_msg_id_and_producer_sequence(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        async with OrderedPublisher(nc, unique_name, producer_id="job-7") as pub:
            for i in range(5):
                await pub.publish("acct-1", f"{i}".encode(), headers={"X-Trace": f"t{i}"})
            await pub.publish("acct-2", b"own-id", msg_id="custom-1")
        sub = await nc.jetstream().pull_subscribe(">", stream=unique_name)
        msgs = await sub.fetch(6, timeout=5)
        await nc.close()
        return msgs

    msgs = asyncio.run(go())
    p1 = partition_for("acct-1", 2)
    first = [m for m in msgs if m.headers[HDR_KEY] == "acct-1"]
    assert [m.headers[HDR_SEQ] for m in first] == ["1", "2", "3", "4", "5"]
    assert all(m.subject == f"{unique_name.lower()}.p.{p1}" for m in first)
    assert first[0].headers[HDR_MSG_ID] == derive_msg_id("job-7", 1, "acct-1", b"0")
    assert first[2].headers["X-Trace"] == "t2" and first[0].headers[HDR_PRODUCER] == "job-7"
    own = [m for m in msgs if m.headers[HDR_KEY] == "acct-2"]
    assert own[0].headers[HDR_MSG_ID] == "custom-1"


def test_bad_records_are_refused_and_nothing_else_is_lost(nats_server, unique_name):
    good = make_records(2_000, keys=20)

    async def go():
        nc = await nats.connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        errors = []
        async with OrderedPublisher(nc, unique_name) as pub:
            for i, (k, body) in enumerate(good):
                await pub.publish(k, body)
                if i == 100:
                    with pytest.raises(MissingKeyError, match="no key") as e1:
                        await pub.publish(None, b"{}")
                    errors.append(str(e1.value))
                    with pytest.raises(MissingKeyError):
                        await pub.publish("", b"{}")
                if i == 500:
                    with pytest.raises(RecordTooLargeError) as e2:
                        await pub.publish("huge-key", b"x" * (nc.max_payload + 1))
                    errors.append(str(e2.value))
                if i == 900:
                    with pytest.raises(RecordError, match="set by the publisher"):
                        await pub.publish("k", b"x", headers={"Nats-Msg-Id": "mine"})
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return pub.summary, stored, errors

    summary, stored, errors = asyncio.run(go())
    assert "allow_keyless" in errors[0]
    assert "'huge-key'" in errors[1] and "max_payload" in errors[1]
    assert summary.refused == 4 and summary.acked == len(good) and summary.failed == 0
    assert sum(check_stored(good, stored, 4, unique_name.lower()).values()) == len(good)


def test_keyless_round_robin_only_when_asked(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with OrderedPublisher(nc, unique_name, allow_keyless=True) as pub:
            for i in range(8):
                await pub.publish(None, str(i).encode())
        await nc.close()
        return pub.summary

    summary = asyncio.run(go())
    assert [p.acked for p in summary.partitions] == [2, 2, 2, 2]


def test_partition_count_comes_from_the_stream_not_the_caller(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=16))
        pub = OrderedPublisher(nc, unique_name, expected_partitions=8)
        with pytest.raises(PartitionMismatchError, match="has 16 partitions .* but 8 were"):
            await pub.start()
        async with OrderedPublisher(nc, unique_name, expected_partitions=16) as ok:
            assert ok.partitions == 16
        await nc.close()

    asyncio.run(go())


def test_stream_without_fast_batches_is_refused_with_the_fix(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        cfg = StreamSpec(unique_name, partitions=2).stream_config()
        cfg.allow_batched = False
        await nc.jetstream().add_stream(cfg)
        with pytest.raises(ConfigError, match="nats-ordered provision --stream"):
            await OrderedPublisher(nc, unique_name).start()
        await nc.close()

    asyncio.run(go())


def test_memory_is_bounded_by_max_pending(nats_server, unique_name):
    """With the server paused nothing is acknowledged: publish() must block at max_pending."""
    records = make_records(3_000, keys=30)

    async def go():
        nc = await nats.connect(nats_server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        pub = OrderedPublisher(nc, unique_name, max_pending=500, max_in_flight=100, ack_timeout=1.0)
        await pub.start()
        high = 0

        async def producer():
            nonlocal high
            for k, body in records:
                await pub.publish(k, body)
                high = max(high, pub._pending)

        nats_server.pause()
        task = asyncio.ensure_future(producer())
        await asyncio.sleep(2.0)
        blocked_at = pub.accepted
        nats_server.resume()
        await task
        summary = await pub.flush()
        await pub.close()
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return blocked_at, high, summary, stored

    blocked_at, high, summary, stored = asyncio.run(go())
    assert blocked_at <= 500, "publish() did not wait while max_pending records were held"
    assert high <= 500
    assert summary.acked == len(records)
    assert sum(check_stored(records, stored, 4, unique_name.lower()).values()) == len(records)


def test_config_knobs_are_validated():
    with pytest.raises(ConfigError, match="max_in_flight must be >= 1"):
        PublisherConfig(max_in_flight=0)
    with pytest.raises(ConfigError, match="ack_timeout must be > 0"):
        PublisherConfig(ack_timeout=0)
    with pytest.raises(ConfigError, match="line breaks"):
        PublisherConfig(producer_id="a\nb")
    with pytest.raises(ConfigError, match="max_pending_bytes must be >= 1"):
        PublisherConfig(max_pending_bytes=0)
    with pytest.raises(ConfigError, match="max_open_batches must be >= 1"):
        PublisherConfig(max_open_batches=0)
    assert PublisherConfig().longest_resend == 126.0
    assert PublisherConfig(max_in_flight=10_000).flow == 500
    assert PublisherConfig(max_in_flight=1).flow == 1


def test_derived_msg_ids_are_deterministic_and_sensitive_to_the_place_in_the_input():
    a = derive_msg_id("run", 1, "k", b"same")
    assert a == derive_msg_id("run", 1, "k", b"same") == derive_msg_id(b"run", 1, b"k", b"same")
    assert a != derive_msg_id("run", 2, "k", b"same")  # same content, later in the input
    assert a != derive_msg_id("run2", 1, "k", b"same")  # another run
    assert a != derive_msg_id("run", 1, "k", b"other")
    assert a != derive_msg_id("run", 1, "k2", b"same")
    assert len(a) == 30
