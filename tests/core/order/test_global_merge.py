"""The pure global merge (core/order/merge.py): exact order from per-partition inputs and
bounds, with plain values; and the sequence mode's merge strategy over it
(core/order/sequence_reader.py), driven through its context alone."""

from __future__ import annotations

import asyncio
import random

import pytest

from airflow_nats_ordered.core.order.merge import GlobalMerge, GlobalOrderViolation
from airflow_nats_ordered.core.order.progress import ReaderProgress
from airflow_nats_ordered.core.order.sequence_reader import SequenceStrategy
from airflow_nats_ordered.core.order.strategy import GlobalReaderStats, ReadingContext


def _drain(m: GlobalMerge) -> list[int]:
    out = []
    while (r := m.pop()) is not None:
        out.append(r[1])
    return out


def test_a_record_waits_until_every_other_partition_is_known_to_be_past_it():
    m = GlobalMerge(3)
    m.add(0, 2, "b")
    m.add(1, 3, "c")
    assert m.pop() is None  # partition 2 has said nothing: a 1 may still come there
    assert m.blocking() == [2]
    m.advance(2, 2)  # nothing below 2 on partition 2: 2 may go, 3 not yet
    assert _drain(m) == [2]
    assert m.blocking() == [2]  # partition 0 is known to be at 3 or later
    m.add(2, 5, "e")
    m.add(0, 4, "d")
    assert _drain(m) == [3, 4]  # 5 waits: partition 1 may still bring something below it
    m.advance(1, 6)
    assert _drain(m) == [5]


def test_out_of_order_arrival_across_partitions_comes_out_in_global_order():
    rng = random.Random(7)
    parts = 4
    seqs: list[list[int]] = [[] for _ in range(parts)]
    for g in range(1, 401):
        seqs[rng.randrange(parts)].append(g)
    m = GlobalMerge(parts)
    cursors = [0] * parts
    out: list[int] = []
    while any(cursors[p] < len(seqs[p]) for p in range(parts)):
        p = rng.randrange(parts)  # arrivals interleave at random
        if cursors[p] < len(seqs[p]):
            m.add(p, seqs[p][cursors[p]], None)
            cursors[p] += 1
        elif cursors[p] == len(seqs[p]):
            m.advance(p, 401)  # the partition's end: a watermark past everything
        out.extend(_drain(m))
    for p in range(parts):
        m.advance(p, 401)
    out.extend(_drain(m))
    assert out == list(range(1, 401))


def test_an_idle_partition_holds_the_merge_until_a_watermark_advances_it():
    m = GlobalMerge(2)
    for g in (2, 3, 4):
        m.add(0, g, g)
    assert m.pop() is None and m.blocking() == [1]  # a 1 may still come on partition 1
    m.advance(1, 4)  # not below 4 (global sequences are unique: 4 is partition 0's)
    assert _drain(m) == [2, 3, 4]
    m.add(0, 6, 6)
    assert not m.advance(1, 3)  # a lower watermark changes nothing
    assert m.pop() is None and m.blocking() == [1]
    m.advance(1, 10)
    assert _drain(m) == [6]


def test_the_first_possible_sequence_needs_no_watermark():
    m = GlobalMerge(3)
    m.add(2, 1, None)
    assert _drain(m) == [1]  # nothing is below 1


def test_a_resumed_merge_refuses_what_was_handed_out_and_starts_above_it():
    m = GlobalMerge(2, after=10)
    with pytest.raises(GlobalOrderViolation):
        m.add(0, 10, None)
    m.add(0, 12, None)
    assert m.pop() is None  # partition 1 may still bring 11
    m.advance(1, 12)
    assert _drain(m) == [12]
    with pytest.raises(GlobalOrderViolation):
        m.add(1, 12, None)  # at or below what was handed out


def test_records_breaking_the_premises_are_refused_and_change_nothing():
    m = GlobalMerge(2)
    m.add(0, 5, None)
    with pytest.raises(GlobalOrderViolation) as err:
        m.add(0, 4, None)  # below its predecessor
    assert err.value.partition == 0 and err.value.g == 4
    m.advance(1, 8)
    with pytest.raises(GlobalOrderViolation):
        m.add(1, 7, None)  # below the partition's watermark
    m.add(1, 9, None)
    assert _drain(m) == [5]
    m.add(0, 9, None)  # the same g on two partitions: two publishers at once
    with pytest.raises(GlobalOrderViolation):
        m.pop()


def test_room_is_a_byte_share_per_partition_but_an_empty_partition_takes_any_record():
    m = GlobalMerge(2, share_bytes=100)
    assert m.room(0)
    m.add(0, 1, None, size=500)  # larger than the share: taken alone
    assert not m.room(0) and m.room(1)
    assert m.buffered_bytes(0) == 500 and m.buffered_bytes() == 500
    m.advance(1, 2)
    assert _drain(m) == [1]
    assert m.room(0) and m.buffered_bytes() == 0


def _strategy(merge: GlobalMerge, handled_last: int, fail_on: int | None = None):
    """A sequence strategy over ``merge`` with a context of plain values: no server, no
    reader. It stops once the record with global sequence ``handled_last`` is handled."""
    log: list[tuple] = []
    stopping = [False]

    async def hand(p, t, item, late, where, why):
        log.append(("hand", p, t, item[0]))
        return t != fail_on

    async def handled(p, seq):
        log.append(("handled", p, seq, progress.g))
        progress.done(p, seq)
        stopping[0] = stopping[0] or progress.g == handled_last

    async def commit_if_due():
        log.append(("commit_if_due",))

    def fail(exc):
        log.append(("fail", type(exc).__name__))
        stopping[0] = True

    progress = ReaderProgress()
    ctx = ReadingContext(
        None,  # no server, no stream: nothing here reads one
        None,
        [],
        [asyncio.Event() for _ in range(merge.partitions)],
        asyncio.Event(),
        0.01,
        GlobalReaderStats(),
        progress,
        stopping=lambda: stopping[0],
        fail=fail,
        hand=hand,
        handled=handled,
        commit_if_due=commit_if_due,
    )
    return SequenceStrategy(ctx, merge), log, progress


def test_the_sequence_strategy_hands_records_over_in_order_and_moves_the_progress():
    m = GlobalMerge(2)
    for p, g, seq in ((0, 1, 1), (1, 2, 1), (0, 3, 2), (1, 4, 2)):
        m.add(p, g, (seq, None, {}, ""))
    strategy, log, progress = _strategy(m, handled_last=4)
    asyncio.run(strategy.release())
    assert [e[2] for e in log if e[0] == "hand"] == [1, 2, 3, 4]
    # the position's key moves before the record is counted (a commit then includes it)
    assert [e[3] for e in log if e[0] == "handled"] == [1, 2, 3, 4]
    assert (progress.g, progress.seqs) == (4, {0: 2, 1: 2})
    assert strategy.held_back() == ([], [])


def test_the_sequence_strategy_stops_before_a_record_its_handler_raised_on_or_a_violation():
    m = GlobalMerge(2)
    for p, g, seq in ((0, 1, 1), (1, 2, 1), (0, 3, 2), (1, 4, 2)):
        m.add(p, g, (seq, None, {}, ""))
    strategy, log, progress = _strategy(m, handled_last=4, fail_on=3)
    asyncio.run(strategy.release())  # the reader's hand stops the reader itself
    assert [e[2] for e in log if e[0] == "hand"] == [1, 2, 3]
    assert (progress.g, progress.seqs) == (2, {0: 1, 1: 1})

    m = GlobalMerge(2)
    m.add(0, 1, (1, None, {}, ""))
    m.add(1, 1, (1, None, {}, ""))  # the same g on two partitions
    strategy, log, progress = _strategy(m, handled_last=1)
    asyncio.run(strategy.release())
    assert log == [("fail", "GlobalOrderViolation")] and progress.g == 0
