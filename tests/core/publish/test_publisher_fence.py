"""A resumed attempt's fence (``OrderedPublisher(fence=...)``): records an earlier attempt of
the run stored *after* this one read the stream (a failed attempt's late records) are found
and passed over, not stored a second time past the duplicate window.

The schedule is the one CI hit through Spark (test_spark_resume's late retry, 299 rows
stored twice): the retry reads the partitions' tails, the failed attempt's records land,
the retry sends after the window. Here the "failed attempt" is a real publisher run to the
end between the read and the retry's first send, so the schedule is the same every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import pytest
from streamcheck import read_stream

from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

#: resends end within the 2 s duplicate window below, so a test can outwait the window
QUICK = PublisherConfig(ack_timeout=0.3, delivery_timeout=0.6, producer_id="run")
WINDOW = 2.0


def _records(n: int, keys: int = 7, tag: str = "") -> list[tuple[str, bytes]]:
    return [(f"key{i % keys}", f"{tag}v{i}".encode()) for i in range(n)]


async def _tails(nc, stream: str) -> dict[int, int]:
    """Per partition with messages, its subject's last stream sequence (the fence)."""
    js = nc.jetstream()
    out: dict[int, int] = {}
    info = await js.stream_info(stream, subjects_filter=">")
    for subject in info.state.subjects or {}:
        msg = await js.get_last_msg(stream, subject)
        out[int(subject.rsplit(".", 1)[1])] = int(msg.seq)
    return out


async def _publish(nc, stream: str, records, **kw) -> OrderedPublisher:
    pub = OrderedPublisher(nc, stream, QUICK, **kw)
    await pub.start()
    try:
        for key, data in records:
            await pub.publish(key, data)
    finally:
        await pub.close(raise_on_failure=False)
    return pub


async def _past_the_window(nc, stream: str) -> None:
    """Until the newest message is older than the duplicate window (a resend of a stored
    msg-id would then be stored again)."""
    js = nc.jetstream()
    last = (await js.stream_info(stream)).state.last_seq
    stored_at = (await js.get_msg(stream, last)).time.timestamp()
    deadline = time.monotonic() + 60
    while time.time() < stored_at + WINDOW + 0.5:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def _late_attempt(nc, stream: str, partitions: int, late) -> dict[int, int]:
    """A fresh stream; the retry's read of its tails (returned: the fence); then the late
    attempt's ``late`` records land and the duplicate window passes."""
    await provision(nc, StreamSpec(stream, partitions=partitions, duplicate_window=WINDOW))
    fence = await _tails(nc, stream)
    done = await _publish(nc, stream, late)
    assert done.summary is not None and done.summary.acked == len(late)
    await _past_the_window(nc, stream)
    return fence


def _late_then_retry(url: str, stream: str, partitions: int, late, records):
    """:func:`_late_attempt`, then the retry publishes ``records`` fenced at what it read:
    its summary and every stored message."""

    async def go():
        nc = await nats.connect(url)
        try:
            fence = await _late_attempt(nc, stream, partitions, late)
            retry = await _publish(nc, stream, records, fence=fence)
            return retry.summary, await read_stream(nc, stream)
        finally:
            await nc.close()

    return asyncio.run(go())


def _per_key(stored) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for s in stored:
        out.setdefault(s.key, []).append(s.data)
    return out


def _expected(records) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for key, data in records:
        out.setdefault(key, []).append(data)
    return out


def test_records_stored_by_an_earlier_attempt_after_the_read_are_passed_over(nats_url, unique_name):
    """The retry read an empty stream; the failed attempt then stored 60 records; the retry
    (120 records: the same 60 first) stores only the 60 new ones, each once, in order."""
    records = _records(120)
    summary, stored = _late_then_retry(nats_url, unique_name, 3, records[:60], records)
    assert summary is not None and summary.failed == 0, summary.to_dict()
    assert sum(p.offset for p in summary.partitions) == 60, summary.to_dict()
    assert summary.acked == 60, summary.to_dict()
    assert len(stored) == 120, f"{len(stored) - 120} records stored twice"
    assert len({s.msg_id for s in stored}) == 120
    assert _per_key(stored) == _expected(records)
    # positions stay 1..n per partition: the retry's records follow the late attempt's
    by_partition: dict[str, list[int]] = {}
    for s in stored:
        by_partition.setdefault(s.subject, []).append(s.seq)
    assert all(seqs == sorted(seqs) for seqs in by_partition.values())


def test_without_the_fence_the_same_schedule_stores_them_twice(nats_url, unique_name):
    """The schedule above is the one that stores twice: the test above fails without its
    fence (what makes it a test of the fence, not of the schedule)."""
    records = _records(40)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2, duplicate_window=WINDOW))
            await _publish(nc, unique_name, records[:20])
            await _past_the_window(nc, unique_name)
            await _publish(nc, unique_name, records)
            return await read_stream(nc, unique_name)
        finally:
            await nc.close()

    assert len(asyncio.run(go())) == 60


def test_late_records_beyond_those_in_hand_are_passed_over_as_they_come(nats_url, unique_name):
    """The retry hands over one record, is refused, and learns 50 positions are stored: the
    49 records it has not handed over yet are passed over as they come (``resume_left``),
    the last of them checked against the stored msg-id."""
    records = _records(80, keys=1)  # one key: one partition, positions 1..80

    async def go():
        nc = await nats.connect(nats_url)
        try:
            fence = await _late_attempt(nc, unique_name, 2, records[:50])
            pub = OrderedPublisher(nc, unique_name, QUICK, fence=fence)
            await pub.start()
            try:
                part = await pub.publish(*records[0])
                lane = pub._lanes[part]
                deadline = time.monotonic() + 30
                while lane.resume_left == 0 and lane.summary.offset == 0:
                    assert time.monotonic() < deadline, "the fence was not refused"
                    await asyncio.sleep(0.02)
                assert lane.summary.offset == 1 and lane.resume_left == 49
                for key, data in records[1:]:
                    await pub.publish(key, data)
            finally:
                await pub.close(raise_on_failure=False)
            return pub.summary, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    summary, stored = asyncio.run(go())
    assert summary is not None and summary.failed == 0, summary.to_dict()
    assert (sum(p.offset for p in summary.partitions), summary.acked) == (50, 30)
    assert [s.data for s in stored] == [d for _, d in records]


def test_other_records_at_the_stored_position_fail_the_partition(nats_url, unique_name):
    """The late attempt stored *other* records (another input under the same producer id):
    the retry sends nothing more of that partition and says why."""
    records = _records(30, keys=1)
    late = _records(10, keys=1, tag="other-")
    summary, stored = _late_then_retry(nats_url, unique_name, 1, late, records)
    assert summary is not None and summary.failed == 30, summary.to_dict()
    error = summary.partitions[0].error or ""
    assert "another record at position 10" in error and "producer id" in error, error
    assert len(stored) == 10 and all(s.data.startswith(b"other-") for s in stored)


def test_another_producers_record_after_the_read_ends_the_fence_and_stores_the_run(
    nats_url, unique_name
):
    """A record of another producer landed after the read: the lane cannot tell what of the
    run is before it, goes on unfenced (as a resume without a fence) and stores the run."""
    records = _records(20, keys=1)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1, duplicate_window=WINDOW))
            fence = await _tails(nc, unique_name)
            other = PublisherConfig(ack_timeout=0.3, delivery_timeout=0.6, producer_id="other")
            async with OrderedPublisher(nc, unique_name, other) as pub:
                await pub.publish("key0", b"someone else's")
            retry = await _publish(nc, unique_name, records, fence=fence)
            return retry.summary, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    summary, stored = asyncio.run(go())
    assert summary is not None and summary.failed == 0 and summary.acked == 20
    assert [s.data for s in stored] == [b"someone else's"] + [d for _, d in records]


def test_a_fence_that_holds_costs_nothing(nats_url, unique_name):
    """Nothing stored since the read: every record is sent, the fence on the first."""
    records = _records(50)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3, duplicate_window=WINDOW))
            await _publish(nc, unique_name, records[:10])
            fence = await _tails(nc, unique_name)
            await _past_the_window(nc, unique_name)
            pub = OrderedPublisher(nc, unique_name, QUICK, fence=fence)
            await pub.start()
            try:
                for key, data in records[10:]:
                    await pub.publish(key, data)
            finally:
                await pub.close()
            return pub, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    pub, stored = asyncio.run(go())
    assert pub.summary is not None and pub.summary.acked == 40, pub.summary.to_dict()
    assert sum(p.offset for p in pub.summary.partitions) == 0  # never refused
    assert all(lane.fence is None for lane in pub._lanes if lane.summary.acked)
    assert _per_key(stored) == _expected(records)


def test_a_resumed_run_passes_over_what_a_late_attempt_stored_after_it_read_the_stream(
    nats_url, unique_name
):
    """``publish_run``: attempt 1 stops after 30 records (partial); attempt 2 reads what is
    stored, then attempt 1's late records land (positions up to 90: a zombie process) and
    attempt 2's input comes past the window. Every record is stored once, in order."""
    from airflow_nats_ordered.core.publish.runs import RunLedger, publish_run
    from airflow_nats_ordered.inputs.files import records_from_rows

    rows = [{"k": f"key{i % 5}", "i": i} for i in range(150)]

    def records(n: int | None = None):
        for i, rec in enumerate(records_from_rows(rows, key_field="k")):
            if i == n:
                raise RuntimeError(f"input lost after {n} records")
            yield rec

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3, duplicate_window=WINDOW))
            with contextlib.suppress(RuntimeError):
                await publish_run(nc, unique_name, records(30), producer_id="run", config=QUICK)
            partial = await (await RunLedger.open(nc, unique_name)).get("run")
            assert partial is not None and partial.status == "partial"

            async def late_then_all():
                # attempt 2 has read the stream; the zombie stores records 31..90
                zombie = OrderedPublisher(
                    nc, unique_name, QUICK, start_after=partial.acked_per_partition
                )
                await zombie.start()
                for rec in list(records_from_rows(rows, key_field="k"))[:90]:
                    await zombie.publish(rec.key, rec.payload)
                await zombie.close()
                assert zombie.summary is not None and zombie.summary.acked == 60
                await _past_the_window(nc, unique_name)
                for rec in records_from_rows(rows, key_field="k"):
                    yield rec

            result = await publish_run(
                nc, unique_name, late_then_all(), producer_id="run", config=QUICK
            )
            return result, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    result, stored = asyncio.run(go())
    assert result.record.status == "complete", result.record.to_dict()
    assert len(stored) == 150, f"{len(stored) - 150} records stored twice"
    got = [int(s.data.split(b'"i":')[1].rstrip(b"}")) for s in stored]
    assert sorted(got) == list(range(150))
    per_key: dict[str, list[int]] = {}
    for s, i in zip(stored, got, strict=True):
        per_key.setdefault(s.key, []).append(i)
    assert all(v == sorted(v) for v in per_key.values()), per_key
    assert result.record.skipped == 90, result.record.to_dict()


async def _refenced(pub: OrderedPublisher, part: int) -> None:
    """Until the lane of ``part`` was refused and read the stored tail again."""
    lane = pub._lanes[part]
    deadline = time.monotonic() + 30
    while lane.resume_left == 0 and lane.summary.offset == 0 and lane.error is None:
        assert time.monotonic() < deadline, "the fence was not refused"
        await asyncio.sleep(0.02)


def test_other_records_found_past_those_in_hand_fail_what_was_passed_over(nats_url, unique_name):
    """The mismatch is found on a record handed over after the refusal (the late attempt
    stored 10 *other* records): the 10 passed over are failed, not counted as stored, and
    close() raises."""
    from airflow_nats_ordered.core.publish.summary import PublishError

    records = _records(10, keys=1)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            fence = await _late_attempt(nc, unique_name, 1, _records(10, keys=1, tag="other-"))
            pub = OrderedPublisher(nc, unique_name, QUICK, fence=fence)
            await pub.start()
            part = await pub.publish(*records[0])
            await _refenced(pub, part)
            for key, data in records[1:]:
                await pub.publish(key, data)
            with pytest.raises(PublishError) as raised:
                await pub.close()
            return raised.value.summary
        finally:
            await nc.close()

    summary = asyncio.run(go())
    p = summary.partitions[0]
    assert (p.offset, p.accepted, p.failed, p.acked) == (0, 10, 10, 0), summary.to_dict()
    assert "another record at position 10" in (p.error or "")


def test_an_input_that_ends_before_what_the_late_attempt_stored_fails_its_partition(
    nats_url, unique_name
):
    """The late attempt stored 50 positions; this attempt's input has 21 records: they are
    not called stored (the ledger would count positions this input never had)."""
    from airflow_nats_ordered.core.publish.summary import PublishError

    records = _records(50, keys=1)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            fence = await _late_attempt(nc, unique_name, 1, records)
            pub = OrderedPublisher(nc, unique_name, QUICK, fence=fence)
            await pub.start()
            part = await pub.publish(*records[0])
            await _refenced(pub, part)
            for key, data in records[1:21]:
                await pub.publish(key, data)
            with pytest.raises(PublishError) as raised:
                await pub.close()
            return raised.value.summary, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    summary, stored = asyncio.run(go())
    p = summary.partitions[0]
    assert (p.offset, p.failed, p.acked) == (0, 21, 0), summary.to_dict()
    assert "ended before that position" in (p.error or ""), p.error
    assert len(stored) == 50


def test_a_record_that_fits_only_without_the_fence_is_sent_unfenced(nats_url, unique_name):
    """The fence's header line would take a record over the stream's max_msg_size: it is
    sent without it (and stored), not refused, and the connection is not broken."""
    from airflow_nats_ordered.core.publish.records import record_rest, rest_form
    from airflow_nats_ordered.core.stream.keys import key_header_line

    limit = 2048
    kb, key_line = key_header_line("key0")
    head = record_rest(rest_form(b"run"), 1, kb, key_line, 1, b"")[2]
    data = b"x" * (limit - head - 5)  # 5 bytes under the limit without the fence

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(
                nc,
                StreamSpec(unique_name, partitions=1, duplicate_window=WINDOW, max_msg_size=limit),
            )
            pub = await _publish(nc, unique_name, [("key0", data), ("key0", b"small")], fence={})
            return pub.summary, await read_stream(nc, unique_name), nc.is_connected
        finally:
            await nc.close()

    summary, stored, connected = asyncio.run(go())
    assert summary is not None and summary.acked == 2 and summary.failed == 0
    assert [s.data for s in stored] == [data, b"small"] and connected


def test_a_refusal_the_tail_does_not_explain_ends_within_the_delivery_timeout(
    nats_url, unique_name
):
    """The caller's own Nats-Expected-Last-Sequence refuses the fenced first record (10071)
    while the tail is where the fence expects it: the lane retries within delivery_timeout
    and fails the records, it does not re-read and resend for ever."""
    from airflow_nats_ordered.core.publish.summary import PublishError

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1, duplicate_window=WINDOW))
            pub = OrderedPublisher(nc, unique_name, QUICK, fence={})
            await pub.start()
            await pub.publish("key0", b"a", headers={"Nats-Expected-Last-Sequence": "999"})
            async with asyncio.timeout(60):
                with pytest.raises(PublishError) as raised:
                    await pub.close()
            return raised.value.summary
        finally:
            await nc.close()

    summary = asyncio.run(go())
    assert summary.failed == 1, summary.to_dict()
    assert "gave up" in (summary.partitions[0].error or ""), summary.partitions[0].error


@pytest.mark.parametrize("left", [0, 1])
def test_a_fence_past_the_tail_is_lowered_to_what_is_there(nats_url, unique_name, left):
    """Messages were removed since the read (or the read came from a replica ahead of the
    one answering now): the fence expects a sequence past the subject's last message. The
    lane fences again at what it reads (after a backoff when a message is there) and
    stores the records; it neither fails them nor resends for ever."""
    records = _records(5, keys=1)

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1, duplicate_window=WINDOW))
            if left:
                other = PublisherConfig(ack_timeout=0.3, delivery_timeout=0.6, producer_id="x")
                async with OrderedPublisher(nc, unique_name, other) as pub:
                    await pub.publish("key0", b"there")
            async with asyncio.timeout(60):
                retry = await _publish(nc, unique_name, records, fence={0: 999})
            return retry.summary, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    summary, stored = asyncio.run(go())
    assert summary is not None and summary.failed == 0 and summary.acked == 5, summary.to_dict()
    assert [s.data for s in stored] == [b"there"] * left + [d for _, d in records]
