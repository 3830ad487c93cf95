"""The exact event-time mode across restarts (issue 18 part 1, reviewed): a producer id used
again after it closed (the next run of a DAG task), and a record below the handed-over
position that the next reader of the group must stop at, not pass over. Real shared
server, real producers and readers."""

from __future__ import annotations

import asyncio

import nats

from airflow_nats_ordered.core.order.merge import GlobalOrderViolation
from airflow_nats_ordered.core.order.producer import GlobalProducer
from airflow_nats_ordered.core.order.producers import record_key
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

WAIT = 60.0
GROUP = "ledger"
T0 = 1_795_000_000_000  # epoch ms


async def _until(cond, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not reached within {WAIT}s: {what}") from None


async def _produce(nc, stream: str, producer: str, times: list[int]) -> None:
    async with GlobalProducer(OrderedPublisher(nc, stream), producer) as prod:
        for e in times:
            await prod.publish(f"k{e % 7}", f"{producer}@{e - T0}".encode(), event_time=e)


def _reader(nc, stream: str, got: list, **kw) -> GlobalOrderReader:
    return GlobalOrderReader(
        nc, stream, GROUP, got.append, order_by="event-time", watermarks=True, **kw
    )


def test_a_producer_id_used_again_after_it_closed_is_merged_not_refused(nats_url, unique_name):
    """'billing' publishes and closes (run 1), then starts again with the same id (run 2,
    a new epoch) while the reader keeps running: its new records are a new registration,
    not 'a record stored after its producer was closed'. The reader checks marks only
    every 2 s here, so it reads run 2's first record before it sees the new mark."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            await _produce(nc, unique_name, "billing", [T0 + 1, T0 + 2, T0 + 3])
            await _produce(nc, unique_name, "audit", [T0 + 10])
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got, poll_interval=2.0)
            await reader.start()
            # audit@10 comes after billing's records only once billing's close is confirmed
            await _until(lambda: len(got) == 4 or reader.error, "run 1's 4 records")
            await _produce(nc, unique_name, "billing", [T0 + 20, T0 + 30])
            await _produce(nc, unique_name, "audit", [T0 + 25])
            await _until(lambda: len(got) == 7 or reader.error, "run 2's 3 records")
            await reader.stop()
            return reader, got
        finally:
            await nc.close()

    reader, got = asyncio.run(go())
    assert reader.error is None, reader.error
    assert [m.data for m in got] == [
        b"billing@1",
        b"billing@2",
        b"billing@3",
        b"audit@10",
        b"billing@20",
        b"audit@25",
        b"billing@30",
    ]
    assert [record_key(m.headers)[2] for m in got if m.data.startswith(b"billing")] == [
        1,
        1,
        1,
        2,
        2,
    ]


def test_a_record_below_the_position_stops_the_next_reader_too(nats_url, unique_name):
    """A producer that registers late and stamps an event time below what the reader
    handed over breaks the order: the running reader stops at it. The next reader of the
    group must stop at it as well, not pass over it as 'handed over before the restart';
    and so must a reader that starts after the record was stored while no reader ran."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1))
            await _produce(nc, unique_name, "early", [T0 + 100, T0 + 200])
            got1: list[GlobalMessage] = []
            r1 = _reader(nc, unique_name, got1, commit_every=1)
            await r1.start()
            await _until(lambda: len(got1) == 2 or r1.error, "early's 2 records")
            # stored while r1 runs: r1 reads it and stops before it
            await _produce(nc, unique_name, "late", [T0 + 50])
            await _until(lambda: r1.error is not None, "r1 stopping at late@50")
            await r1.stop()
            # a record after it that would be handed over if late@50 were passed over
            await _produce(nc, unique_name, "after", [T0 + 300])
            got2: list[GlobalMessage] = []
            r2 = _reader(nc, unique_name, got2)
            await r2.start()
            await _until(lambda: r2.error is not None or got2, "r2 stopping or handing over")
            await r2.stop()
            return r1, got1, r2, got2
        finally:
            await nc.close()

    r1, got1, r2, got2 = asyncio.run(go())
    assert [m.data for m in got1] == [b"early@100", b"early@200"]
    assert isinstance(r1.error, GlobalOrderViolation), r1.error
    assert [m.data for m in got2] == [], "the next reader passed over late@50"
    assert isinstance(r2.error, GlobalOrderViolation), r2.error
    assert "late" in str(r2.error) and "stream sequence 3" in str(r2.error), r2.error


def test_a_record_below_the_position_stored_while_no_reader_ran(nats_url, unique_name):
    """The reader stopped cleanly at its position; then a late producer stores a record
    below it. The reader started again must stop at it, not pass over it."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1))
            await _produce(nc, unique_name, "early", [T0 + 100, T0 + 200])
            got1: list[GlobalMessage] = []
            r1 = _reader(nc, unique_name, got1)
            await r1.start()
            await _until(lambda: len(got1) == 2 or r1.error, "early's 2 records")
            await r1.stop()
            await _produce(nc, unique_name, "late", [T0 + 50])
            await _produce(nc, unique_name, "after", [T0 + 300])
            got2: list[GlobalMessage] = []
            r2 = _reader(nc, unique_name, got2)
            await r2.start()
            await _until(lambda: r2.error is not None or got2, "r2 stopping or handing over")
            await r2.stop()
            return r1, got1, r2, got2
        finally:
            await nc.close()

    r1, got1, r2, got2 = asyncio.run(go())
    assert r1.error is None and [m.data for m in got1] == [b"early@100", b"early@200"]
    assert [m.data for m in got2] == [], "the restarted reader passed over late@50"
    assert isinstance(r2.error, GlobalOrderViolation), r2.error
    assert "stream sequence 3" in str(r2.error), r2.error


def test_an_event_time_before_1970_is_refused_at_the_producer(nats_url, unique_name):
    """The event-time header's forms cannot carry a time before the Unix epoch (whole
    milliseconds would be written as '-86400000', which readers refuse). The producer
    refuses it naming the reason; a new producer's refusal used to blame 'the last
    watermark of its earlier instance (same producer id)', which did not exist. Nothing
    is sent, and the reader hands over the rest."""
    from datetime import UTC, datetime

    import pytest

    from airflow_nats_ordered.core.errors import RecordError

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1))
            async with GlobalProducer(OrderedPublisher(nc, unique_name), "old") as prod:
                with pytest.raises(RecordError) as err:
                    await prod.publish("a", b"x", event_time=datetime(1969, 12, 31, tzinfo=UTC))
                await prod.publish("a", b"ok", event_time=T0)
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got)
            await reader.start()
            await _until(lambda: got or reader.error, "the record or an error")
            await reader.stop()
            info = await nc.jetstream().stream_info(unique_name)
            return err.value, info.state.messages, got, reader.error
        finally:
            await nc.close()

    err, stored, got, error = asyncio.run(go())
    assert "1969-12-31" in str(err) and "before 1970" in str(err), err
    assert "earlier instance" not in str(err), err
    assert stored == 1 and error is None and [m.data for m in got] == [b"ok"]
