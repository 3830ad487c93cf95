"""Several producers publishing at the same time into one exact event-time order (issue 18
part 1): GlobalProducer stamps (event time, producer, epoch.n), registers and writes
watermarks; GlobalOrderReader(order_by="event-time", watermarks=True) merges exactly, with
no window. Real shared server; the merge's rules are also checked as plain values."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.errors import ConfigError, RecordError
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER
from airflow_nats_ordered.core.order.merge import GlobalOrderViolation
from airflow_nats_ordered.core.order.producer import GlobalProducer
from airflow_nats_ordered.core.order.producer_merge import ProducerMerge
from airflow_nats_ordered.core.order.producers import (
    ProducerFenced,
    close_producer,
    list_producers,
    record_key,
)
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for

WAIT = 60.0
GROUP = "merged"
T0 = 1_795_000_000_000  # epoch ms


async def _until(cond, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not reached within {WAIT}s: {what}") from None


def _keys(p: int, partitions: int, n: int) -> list[str]:
    return [k for k in (f"k{i}" for i in range(1000)) if partition_for(k, partitions) == p][:n]


def test_merge_waits_for_every_open_producer_and_refuses_what_breaks_the_order():
    m = ProducerMerge(2)
    m.set_marks({"a": None, "b": None}, {})
    m.add(0, (5, "b", 1, 1), "b1", 1)
    m.add(1, (5, "a", 1, 1), "a1", 1)
    assert m.pop() is None and m.holders() == ["a", "b"]
    m.set_marks({"a": (9, "a", 1, 3), "b": (5, "b", 1, 1)}, {})
    assert m.pop() == (1, (5, "a", 1, 1), "a1")  # equal event times: producer id decides
    assert m.pop() == (0, (5, "b", 1, 1), "b1")
    assert m.pop() is None
    with pytest.raises(GlobalOrderViolation, match="arrived after"):
        m.add(0, (4, "a", 1, 2), "late", 1)
    m.set_marks({"a": (9, "a", 1, 3)}, {"b": 1})
    with pytest.raises(GlobalOrderViolation, match="after that producer was closed"):
        m.add(0, (10, "b", 1, 2), "b2", 1)
    m.add(0, (10, "a", 1, 4), "a4", 1)
    m.add(1, (12, "c", 1, 1), "c1", 1)
    m.set_marks({"a": (20, "a", 1, 9)}, {"b": 1})
    # c is not the head, but its unread records may be smaller: it holds the merge back
    assert m.unknown() == {"c"} and m.pop() is None and m.holders() == ["c"]
    m.set_marks({"a": (20, "a", 1, 9), "c": (12, "c", 1, 1)}, {"b": 1})
    assert [m.pop()[2], m.pop()[2], m.pop()] == ["a4", "c1", None]


def test_two_producers_at_once_are_merged_exactly_and_a_restart_resumes(nats_url, unique_name):
    """Two producers publish concurrently (each its own connection) with interleaved and
    equal event times, on shared and separate partitions, while the reader runs; the reader
    is crashed (its task cancelled) mid-merge and a second one of the group resumes."""
    parts = 3
    shared = _keys(0, parts, 3)
    own = {"alpha": _keys(1, parts, 2), "beta": _keys(2, parts, 2)}

    def event_times(name: str) -> list[int]:
        # alpha: T0, T0+10, ...; beta 5 ms later; every 4th record both at the same time
        off = 0 if name == "alpha" else 5
        return [T0 + 10 * i + (0 if i % 4 == 0 else off) for i in range(40)]

    async def produce(name: str, sent: list, go_on: asyncio.Event) -> None:
        nc = await nats.connect(nats_url)
        try:
            async with GlobalProducer(OrderedPublisher(nc, unique_name), name) as prod:
                for i, e in enumerate(event_times(name)):
                    if i == 30:  # open, not closed: what the reader hands over until the
                        await go_on.wait()  # crash was released by watermarks alone
                    key = shared[i % 3] if i % 2 else own[name][i % 2]
                    await prod.publish(key, f"{name}-{i}".encode(), event_time=e)
                    sent.append((e * 1_000_000, name, prod.epoch, i + 1))
                    if i % 7 == 0:
                        await asyncio.sleep(0.01)  # let the other producer interleave
        finally:
            await nc.close()

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=parts))
            got1: list[GlobalMessage] = []
            got2: list[GlobalMessage] = []
            r1 = GlobalOrderReader(
                nc,
                unique_name,
                GROUP,
                got1.append,
                order_by="event-time",
                watermarks=True,
                commit_every=1,
                member_id="r1",
            )
            run1 = asyncio.ensure_future(r1.run())
            sent_a: list = []
            sent_b: list = []
            go_on = asyncio.Event()
            producing = asyncio.gather(
                produce("alpha", sent_a, go_on), produce("beta", sent_b, go_on)
            )
            await _until(lambda: len(got1) >= 25 or run1.done(), "25 records handed over")
            run1.cancel()  # a crash: nothing more is committed
            await asyncio.gather(run1, return_exceptions=True)
            go_on.set()
            await producing
            r2 = GlobalOrderReader(
                nc,
                unique_name,
                GROUP,
                got2.append,
                order_by="event-time",
                watermarks=True,
                member_id="r2",
            )
            await r2.start()
            total = len(sent_a) + len(sent_b)
            await _until(lambda: len(got2) >= total - len(got1) or r2.error, "the rest")
            await r2.stop()
            marks = await list_producers(nc, unique_name)
            return r1, r2, got1, got2, sorted(sent_a + sent_b), marks
        finally:
            await nc.close()

    r1, r2, got1, got2, expected, marks = asyncio.run(go())
    assert r2.error is None, r2.error
    k1 = [record_key(m.headers) for m in got1]
    k2 = [record_key(m.headers) for m in got2]
    assert len(expected) == 80 and len(set(expected)) == 80
    assert 25 <= len(k1) <= 60  # crashed in the middle, before the producers went on
    assert k1 == expected[: len(k1)], "the first reader's order is not the exact key order"
    # the second reader resumes at the first one's position: at most the record in hand
    # at the crash again (at least once), then exactly the rest, in order
    redo = len(k1) + len(k2) - len(expected)
    assert redo in (0, 1), (len(k1), len(k2))
    assert k2 == expected[len(k1) - redo :]
    assert [m.global_seq for m in got2] == [k[0] for k in k2]
    # both producers' records on one partition were handed over out of stream order
    on_shared = [(m.stream_seq, record_key(m.headers)) for m in got1 + got2 if m.partition == 0]
    assert sorted(on_shared) != sorted(on_shared, key=lambda x: x[1])
    assert {p: m.state for p, m in marks.items()} == {"alpha": "closed", "beta": "closed"}


def test_a_silent_producer_holds_the_merge_back_until_closed(nats_url, unique_name, capsys):
    """'quiet' registers and publishes nothing: 'loud''s records wait (status names quiet),
    then close_producer releases them."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            quiet = GlobalProducer(OrderedPublisher(nc, unique_name), "quiet")
            await quiet.start()
            async with GlobalProducer(OrderedPublisher(nc, unique_name), "loud") as loud:
                for i in range(5):
                    await loud.publish(f"k{i}", b"%d" % i, event_time=T0 + i)
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(
                nc, unique_name, GROUP, got.append, order_by="event-time", watermarks=True
            )
            await reader.start()
            await _until(lambda: reader.stats.watermark_advances >= 1, "the marks confirmed")
            status: dict = {}
            async with asyncio.timeout(WAIT):  # status names the producer holding it back
                while not any("quiet" in p for p in status.get("problems", [])):
                    await asyncio.sleep(0.5)
                    status = await asyncio.to_thread(_status_json, nats_url, unique_name, capsys)
            held = list(got)  # seconds of polls later: still nothing handed over
            holders = reader._pmerge.holders() if reader._pmerge else None
            assert await close_producer(nc, unique_name, "quiet") is True
            assert await close_producer(nc, unique_name, "quiet") is False
            await _until(lambda: len(got) == 5 or reader.error, "the 5 records")
            await reader.stop()
            with pytest.raises(ProducerFenced):
                await quiet.close()  # closed by the operator: this instance is fenced
            return held, holders, status, got, reader
        finally:
            await nc.close()

    held, holders, status, got, reader = asyncio.run(go())
    assert held == [] and holders == ["quiet"]
    assert status["global_order"]["order"] == "event-time-exact", status
    assert status["global_order"]["held_back_by"] == ["quiet"], status
    (problem,) = [p for p in status["problems"] if "quiet" in p]
    assert "held back" in problem and "quiet (watermark none)" in problem, problem
    assert f"--stream {unique_name} --close quiet" in problem, problem
    assert [m.data for m in got] == [b"%d" % i for i in range(5)] and reader.error is None


def _status_json(url: str, stream: str, capsys) -> dict:
    capsys.readouterr()
    assert cli(["status", "--stream", stream, "--group", GROUP, "--json", "--server", url]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_decreasing_event_time_is_refused_and_a_restart_keeps_the_floor(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            prod = GlobalProducer(OrderedPublisher(nc, unique_name), "p1")
            await prod.start()
            await prod.publish("a", b"1", event_time=T0 + 10)
            await prod.publish("b", b"2", event_time=T0 + 10)  # equal: fine
            with pytest.raises(RecordError) as back:
                await prod.publish("c", b"3", event_time=T0 + 9)
            with pytest.raises(RecordError, match="set by the producer"):
                await prod.publish("c", b"3", headers={DEFAULT_TIME_HEADER: "1"})
            await prod.close()
            again = GlobalProducer(OrderedPublisher(nc, unique_name), "p1")
            await again.start()
            with pytest.raises(RecordError) as floor:
                await again.publish("d", b"4", event_time=T0 + 5)
            await again.publish("d", b"4", event_time=T0 + 10)
            await again.close()
            s = await describe(nc, unique_name)
            info = await nc.jetstream().stream_info(unique_name)
            return back.value, floor.value, again.epoch, info.state.messages, s
        finally:
            await nc.close()

    back, floor, epoch, stored, _ = asyncio.run(go())
    text = str(back)
    assert "producer p1" in text and "2026-11-18T" in text, text
    assert ".009000000Z" in text and ".010000000Z" in text, text
    assert "earlier instance" in str(floor) and epoch == 2
    assert stored == 3  # nothing of the refused records was sent


def test_reader_refuses_records_without_the_producer_headers(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1))
            async with OrderedPublisher(nc, unique_name) as pub:
                await pub.publish("k", b"plain")
            reader = GlobalOrderReader(
                nc, unique_name, GROUP, lambda m: None, order_by="event-time", watermarks=True
            )
            await reader.start()
            await _until(lambda: reader.error is not None, "the reader to stop")
            await reader.stop()
            return reader.error
        finally:
            await nc.close()

    error = asyncio.run(go())
    assert isinstance(error, GlobalOrderViolation)
    assert "partition 0, stream sequence 1: header Nats-Ordered-Event-Time" in str(error)
    assert "not published through a GlobalProducer" in str(error)


def test_exact_mode_refuses_window_parameters():
    with pytest.raises(ConfigError, match="lateness applies to the window modes"):
        GlobalOrderReader(None, "S", "g", print, order_by="event-time", watermarks=True, lateness=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pass order_by='event-time'"):
        GlobalOrderReader(None, "S", "g", print, watermarks=True)  # type: ignore[arg-type]


def test_an_idle_producer_advances_and_a_restart_fences_the_earlier_instance(nats_url, unique_name):
    """'idle' publishes nothing: advance() lets the reader hand over 'busy''s records and
    refuses an earlier event time afterwards. A second instance of 'busy' takes its mark
    over: the first one can write no watermark and publish nothing more."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            idle = GlobalProducer(OrderedPublisher(nc, unique_name), "idle")
            await idle.start()
            busy = GlobalProducer(OrderedPublisher(nc, unique_name), "busy")
            await busy.start()
            for i in range(3):
                await busy.publish(f"k{i}", b"%d" % i, event_time=T0 + i)
            await busy.watermark()
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(
                nc, unique_name, GROUP, got.append, order_by="event-time", watermarks=True
            )
            await reader.start()
            await _until(lambda: reader.stats.watermark_advances >= 1, "the marks confirmed")
            before = len(got)
            await idle.advance(T0 + 100)
            await _until(lambda: len(got) == 3 or reader.error, "busy's 3 records")
            with pytest.raises(RecordError) as refused:
                await idle.publish("k", b"x", event_time=T0 + 50)
            again = GlobalProducer(OrderedPublisher(nc, unique_name), "busy")
            await again.start()
            await busy.publish("k", b"late", event_time=T0 + 10)  # accepted, then fenced:
            with pytest.raises(ProducerFenced):
                await busy.watermark()
            with pytest.raises(RecordError, match="publishes no more records"):
                await busy.publish("k", b"more", event_time=T0 + 11)
            await reader.stop()
            await again.close()
            await idle.close()
            return before, got, reader, str(refused.value), again.epoch
        finally:
            await nc.close()

    before, got, reader, refused, epoch = asyncio.run(go())
    assert before == 0 and [m.data for m in got] == [b"0", b"1", b"2"] and reader.error is None
    assert "below the time it advanced to (advance())" in refused, refused
    assert epoch == 2


def test_a_producer_that_keeps_publishing_still_writes_watermarks(nats_url, unique_name):
    """A tight publishing loop keeps the publisher's lanes busy all the time: a watermark
    waits for the records it covers to be stored, not for every lane to be idle at once
    (with pub.flush() no watermark was written for as long as the loop ran, so readers
    waited for the producer to pause)."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            prod = GlobalProducer(OrderedPublisher(nc, unique_name), "busy")
            await prod.start()
            sent, mark = 0, None
            async with asyncio.timeout(WAIT):
                while sent < 300_000:
                    await prod.publish(f"k{sent % 50}", b"x", event_time=T0 + sent // 100)
                    sent += 1
                    if sent % 2000 == 0:  # the mark as a reader sees it, while publishing
                        mark = (await list_producers(nc, unique_name))["busy"]
                        if mark.e is not None:
                            break
            await prod.close()
            return sent, mark, prod.watermarked
        finally:
            await nc.close()

    sent, mark, last = asyncio.run(go())
    assert mark is not None and mark.e is not None, f"no watermark while {sent} were published"
    assert mark.state == "open" and 1 <= mark.n <= sent and last is not None
