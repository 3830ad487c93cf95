"""The merge strategy of the global-order reader: what :class:`~.reader.GlobalOrderReader`
calls on one (:class:`MergeStrategy`) and what it lends one (:class:`ReadingContext`).

A strategy is one way of merging every partition into one order, one object per mode:

* by global sequence (``order_by="sequence"``, :mod:`.sequence_reader`), exact;
* in a time window, by stored or event time (``order_by="time"`` or ``"event-time"``,
  :mod:`.window_reader`), with a late-record policy;
* by producer watermarks (``order_by="event-time", watermarks=True``,
  :mod:`.producer_reader`), exact.

The reader picks the strategy, takes the position and builds the partitions' readers; then
it runs the strategy's :meth:`~MergeStrategy.fetch` once per partition beside one
:meth:`~MergeStrategy.release` until it stops. The strategy hands each record over through
the context (:attr:`ReadingContext.hand`, then :attr:`ReadingContext.handled`), moving the
reader's :class:`~.progress.ReaderProgress` between the two, and the reader counts it and
writes the position; a strategy never touches the reader itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.order.progress import ReaderProgress
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.stream.reader import PartitionReader


@dataclass
class GlobalReaderStats:
    """The counters of a :class:`~.reader.GlobalOrderReader` (``reader.stats``)."""

    handled: int = 0
    commits: int = 0
    #: times a partition's bound was raised by its watermark (an idle partition advanced)
    watermark_advances: int = 0
    #: time-window mode: late records met by this reader (flagged, dead-lettered or blocked)
    late: int = 0
    dead_lettered: int = 0
    #: event-time mode: records without a usable time header, set aside (late="dead-letter")
    untimed: int = 0


@dataclass(frozen=True, slots=True)
class ReadingContext:
    """What the reader lends its merge strategy, and nothing more.

    A record a strategy reads is an item ``(stream seq, message, headers, key)``."""

    nc: NATS
    stream: PartitionedStream
    #: one per partition, reading on from the position
    readers: list[PartitionReader]
    #: per partition: set when its buffer in the merge has room again
    space: list[asyncio.Event]
    #: set when a fetcher has read something, or the reader stops
    wake: asyncio.Event
    #: seconds between checks (watermarks, producer marks) while the merge is held back
    poll_interval: float
    stats: GlobalReaderStats
    #: what is done: the strategy moves it, the reader writes it
    progress: ReaderProgress
    #: whether the reader is stopping (every loop of the strategy ends when it is)
    stopping: Callable[[], bool]
    #: stop the reader on its own with this error (it becomes ``reader.error``)
    fail: Callable[[BaseException], None]
    #: ``hand(p, t, item, late, where, why)``: call the handler with the record ``item`` of
    #: partition ``p`` at ``t`` (``msg.global_seq``); False if it raised: the reader then
    #: stops before it (``where`` names it, ``why`` says why it is not skipped)
    hand: Callable[[int, int, Any, bool, str, str], Awaitable[bool]]
    #: ``handled(p, seq)``: the record was handed over: count it done, maybe write the
    #: position (move ``progress``'s key first)
    handled: Callable[[int, int], Awaitable[None]]
    #: write the position if ``commit_interval`` has passed with changes unwritten
    commit_if_due: Callable[[], Awaitable[None]]


class MergeStrategy(Protocol):
    """What the reader calls on its merge strategy."""

    async def fetch(self, p: int) -> None:
        """Read partition ``p`` into the merge until the reader stops (or fails)."""

    async def release(self) -> None:
        """Hand the merged records over in order until the reader stops (or fails)."""

    def held_back(self) -> tuple[list[str], list[str]]:
        """For the heartbeat: who holds the merge back (``held_back_by``), and the
        problems ``status`` shows about it."""


__all__ = ["GlobalReaderStats", "MergeStrategy", "ReadingContext"]
