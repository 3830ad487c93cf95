"""What the publisher calls to stamp its records with a sequence over the whole stream.

The publisher does not know global order: it knows that, given a :class:`StreamSequence`
(``PublisherConfig(global_order=...)``), every record it accepts carries the next number
of that sequence in the sequence's header, taken with the record's position, and that
the sequence's :class:`SequenceMarks` are written from its idle points. Global order
(:mod:`..order.watermarks`, ``GlobalOrder``) provides both: the header
``Nats-Global-Seq``, the first number (above everything stored, under the stream's
sequencer claim) and the watermarks. So global order builds on the publisher, never the
other way round.

Guarantees the publisher keeps for the marks: ``idle()`` is one synchronous step, so the
next number and the partitions it returns as idle (nothing queued, nothing awaiting its
acknowledgement, no failure) are one state of the publisher: every record of an idle
partition with a smaller number is stored, and every later one gets that number or more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.stream.partitioned import PartitionedStream

#: the publisher's idle point, read in one synchronous step: (its next sequence number,
#: the partitions whose lane is idle and has not failed)
IdlePoint = Callable[[], tuple[int, list[int]]]


class SequenceMarks(Protocol):
    """Marks of one publisher's sequence (global order: its watermarks and sequencer claim)."""

    async def write(self) -> None:
        """One round of marks from the publisher's idle point; called once its lanes run
        (every partition idle) and after every flush (everything stored)."""

    def start(self) -> None:
        """Write marks periodically from now on."""

    async def close(self) -> None:
        """Stop writing and give up whatever the sequence holds for this publisher."""


class StreamSequence(Protocol):
    """A sequence over the whole stream for the publisher to stamp (global order's
    ``GlobalOrder``). One publisher at a time per stream may hold it: :meth:`open` may
    refuse (raise) when another one does."""

    #: the header each record's number goes in
    header: str

    async def open(
        self,
        nc: NATS,
        stream: PartitionedStream,
        producer_id: str,
        idle: IdlePoint,
        interval: float,
    ) -> tuple[int, SequenceMarks]:
        """Before the publisher sends anything: the first number for it and its marks
        (written from ``idle`` every ``interval`` seconds once started)."""
        ...


__all__ = ["IdlePoint", "SequenceMarks", "StreamSequence"]
