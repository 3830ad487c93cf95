"""The publisher against the server's limits and its own: batches in flight, bytes held.

Issue 7, items 3 and 14 (publisher part), and the keyless refusal that names the switch
of the interface in use.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from streamcheck import check_stored, make_records, read_stream

from airflow_nats_ordered.core.errors import KeylessRecordError, MissingKeyError
from airflow_nats_ordered.core.publish.lane import _Lane
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

MB = 1_000_000


def _publish_many_partitions(url: str, stream: str, hold_batches: int = 0):
    """Publish 3,600 records over 1,200 partitions, after opening ``hold_batches`` fast
    batches that are never finished (another writer's, or abandoned ones)."""
    records = make_records(3_600, keys=3_600)

    async def go():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=1_200))
        inbox = nc.new_inbox()
        for i in range(hold_batches):
            reply = f"{inbox}.hold{i}.1.fail.1.0.$FI"
            await nc.publish(f"{stream.lower()}.p.0", b"held", reply=reply)
        async with OrderedPublisher(nc, stream) as pub:
            for k, body in records:
                await pub.publish(k, body)
        stored = [s for s in await read_stream(nc, stream) if s.data != b"held"]
        await nc.close()
        return pub.summary, stored

    summary, stored = asyncio.run(go())
    assert summary.failed == 0 and summary.acked == len(records)
    assert sum(check_stored(records, stored, 1_200, stream.lower()).values()) == len(records)
    return summary


def test_publisher_on_1200_partitions_stores_every_record(nats_server, unique_name, monkeypatch):
    """One batch per partition would be 1,200 open batches, over the server's 1,000 per
    stream: the publisher keeps at most max_open_batches (256) open."""
    real_open = _Lane._open
    most = {"open": 0}

    async def counting_open(lane: _Lane) -> None:
        await real_open(lane)
        now = sum(1 for other in lane.pub._lanes if other.batch_id is not None)
        most["open"] = max(most["open"], now)

    monkeypatch.setattr(_Lane, "_open", counting_open)
    _publish_many_partitions(nats_server.url, unique_name)
    assert 0 < most["open"] <= 256, f"{most['open']} batches were open at once"


def test_too_many_batches_in_flight_is_retried_not_fatal(nats_server, unique_name):
    """Err 10211 (HTTP 429) is a temporary server limit: with 1,000 batches of another
    writer open (they count until abandoned after 10 s), every partition is refused at
    first and must be retried with backoff until stored."""
    summary = _publish_many_partitions(nats_server.url, unique_name, hold_batches=1_000)
    assert sum(p.retries for p in summary.partitions) > 0, "the server limit was not hit"


def test_batch_publishing_disabled_mid_run_names_the_fix(nats_url, unique_name):
    """Err 10205: the stream's allow_batched was turned off after start()."""

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        pub = OrderedPublisher(nc, unique_name)
        await pub.start()
        js = nc.jetstream()
        cfg = (await js.stream_info(unique_name)).config
        cfg.allow_batched = False
        await js.update_stream(cfg)
        await pub.publish("k", b"x")
        with pytest.raises(PublishError) as exc_info:
            await pub.flush()
        await pub.close(raise_on_failure=False)
        await nc.close()
        return str(exc_info.value)

    msg = asyncio.run(go())
    assert "does not allow fast batch publishing" in msg and "nats-ordered provision" in msg


def test_memory_is_bounded_by_max_pending_bytes_with_1mb_records(nats_server, unique_name):
    """With the server paused nothing is acknowledged: publish() must wait once
    max_pending_bytes of payload are held, long before max_pending records."""
    records = [(f"k{i % 4}", (b"%d:" % i).ljust(MB, b"x")) for i in range(12)]

    async def go():
        nc = await nats.connect(nats_server.url, reconnect_time_wait=0.2)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        pub = OrderedPublisher(nc, unique_name, max_pending_bytes=3_500_000, ack_timeout=1.0)
        await pub.start()
        high = 0

        async def producer():
            nonlocal high
            for k, body in records:
                await pub.publish(k, body)
                high = max(high, pub._pending_bytes)

        nats_server.pause()
        task = asyncio.ensure_future(producer())
        await asyncio.sleep(1.5)
        blocked_at = pub.accepted
        nats_server.resume()
        await task
        summary = await pub.flush()
        await pub.close()
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return blocked_at, high, summary, stored

    blocked_at, high, summary, stored = asyncio.run(go())
    assert blocked_at == 3, f"publish() accepted {blocked_at} 1 MB records under a 3.5 MB bound"
    assert high <= 3_500_000
    assert summary.acked == len(records)
    assert sum(check_stored(records, stored, 4, unique_name.lower()).values()) == len(records)


def test_record_larger_than_the_byte_bound_still_goes_alone(nats_url, unique_name):
    """Progress is always possible: a record over max_pending_bytes is accepted when
    nothing else is held, and only then."""
    records = [("k", (b"%d:" % i).ljust(200_000, b"x")) for i in range(5)]

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        held = []
        async with OrderedPublisher(nc, unique_name, max_pending_bytes=100_000) as pub:
            for k, body in records:
                await pub.publish(k, body)
                held.append(pub._pending)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return held, pub.summary, stored

    held, summary, stored = asyncio.run(go())
    assert max(held) == 1
    assert summary.acked == 5
    assert sum(check_stored(records, stored, 1, unique_name.lower()).values()) == 5


def test_keyless_refusal_names_the_switch_of_the_interface_in_use(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        async with OrderedPublisher(nc, unique_name) as pub:
            with pytest.raises(MissingKeyError) as exc_info:
                await pub.publish(None, b"{}")
        await nc.close()
        return exc_info.value

    exc = asyncio.run(go())
    assert isinstance(exc, KeylessRecordError)
    assert "publish with allow_keyless=True for round-robin" in str(exc)
    cli = exc.message_for("--allow-keyless")
    assert "publish with --allow-keyless for round-robin" in cli and "allow_keyless=" not in cli
