"""The exact merge of partitions into one global order (:class:`GlobalMerge`): pure, no I/O.

Each partition delivers its records in stream order, each with a global sequence ``g``
(``Nats-Global-Seq``) that strictly increases along the partition. For each partition the
merge keeps the records buffered so far and a **bound**: no record of that partition not
yet buffered has a ``g`` below it. A buffered record raises its partition's bound to
``g + 1``; a watermark (:meth:`GlobalMerge.advance`) raises it to the watermark.

Guarantee: :meth:`GlobalMerge.pop` hands out records in strictly increasing ``g``, and
hands out a record ``c`` only when every partition either has a buffered head ``>= c`` or
an empty buffer with a bound ``>= c``: nothing smaller than ``c`` can still arrive (global
sequences are unique: one sequencer numbers them), so the order handed out is exact, not
guessed. Input that breaks the premises (a ``g`` below its
partition's bound or at most the last one handed out, the same ``g`` on two partitions) is
refused with :class:`GlobalOrderViolation` and changes nothing. Why the bounds are true is
in ``docs/architecture/order.md`` (*Global order*).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from airflow_nats_ordered.core.errors import NatsOrderedError


class GlobalOrderViolation(NatsOrderedError):
    """A record breaks the global order's premises (published without a global sequence,
    by two publishers at once, or below a watermark): handing it over would be out of
    order, so the reader stops before it."""

    def __init__(self, message: str, partition: int, g: int | None = None) -> None:
        super().__init__(message)
        self.partition = partition
        self.g = g


class GlobalMerge:
    """Merges ``partitions`` ordered inputs by global sequence, exactly.

    ``after``: the last ``g`` already handed out before (a resumed position; 0 for none):
    every partition's bound starts at ``after + 1``, and records at or below it are
    refused. ``share_bytes``: the most each partition's buffer holds (see :meth:`room`).
    """

    def __init__(self, partitions: int, after: int = 0, share_bytes: int = 1 << 62) -> None:
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions!r}")
        self.partitions = partitions
        self.released = after
        self.share_bytes = max(1, share_bytes)
        self._bufs: list[deque[tuple[int, Any, int]]] = [deque() for _ in range(partitions)]
        self._bytes = [0] * partitions
        self._bound = [after + 1] * partitions
        self._last = [after] * partitions  # the highest g buffered per partition
        self._heads: list[tuple[int, int]] = []  # (head g, partition) of non-empty buffers

    # -- input ---------------------------------------------------------------------------
    def add(self, partition: int, g: int, item: Any, size: int = 0) -> None:
        """Buffer ``item`` (the next record of ``partition`` in stream order) with global
        sequence ``g``; raises :class:`GlobalOrderViolation` if ``g`` is not above what is
        known of the partition."""
        p = partition
        if g <= self._last[p] or g < self._bound[p] or g <= self.released:
            known = max(self._last[p], self._bound[p] - 1, self.released)
            raise GlobalOrderViolation(
                f"partition {p}: a record with global sequence {g} follows {known} (its "
                "previous record, a watermark or the position already handed over): the "
                "stream was published by more than one global-order publisher at once, or a "
                "producer broke the watermark promise; the reader stops before this record",
                p,
                g,
            )
        buf = self._bufs[p]
        if not buf:
            heapq.heappush(self._heads, (g, p))
        buf.append((g, item, size))
        self._bytes[p] += size
        self._last[p] = g
        self._bound[p] = g + 1

    def advance(self, partition: int, watermark: int) -> bool:
        """Nothing of ``partition`` not yet buffered will have a ``g`` below ``watermark``.
        Returns True if that raised the partition's bound."""
        if watermark > self._bound[partition]:
            self._bound[partition] = watermark
            return True
        return False

    # -- output --------------------------------------------------------------------------
    def pop(self) -> tuple[int, int, Any] | None:
        """The next record in global order as ``(partition, g, item)``, or None while it is
        not yet known (a partition with an empty buffer may still bring a smaller one)."""
        if not self._heads:
            return None
        c, p = self._heads[0]
        for q in range(self.partitions):
            if q != p and not self._bufs[q] and self._bound[q] < c:
                return None
        if len(self._heads) > 1:
            second = min(self._heads[1:3])  # the heap's next-smallest is one of its children
            if second[0] == c:
                raise GlobalOrderViolation(
                    f"partitions {p} and {second[1]} both hold a record with global sequence "
                    f"{c}: the stream was published by more than one global-order publisher "
                    "at once; the reader stops before these records",
                    second[1],
                    c,
                )
        heapq.heappop(self._heads)
        buf = self._bufs[p]
        g, item, size = buf.popleft()
        self._bytes[p] -= size
        if buf:
            heapq.heappush(self._heads, (buf[0][0], p))
        self.released = g
        return p, g, item

    def blocking(self) -> list[int]:
        """Partitions whose empty buffer keeps the merge from handing out anything: every
        empty one if nothing is buffered, else those with a bound below the smallest head.
        A watermark (or a record) for each of them is what is waited for."""
        empty = [q for q in range(self.partitions) if not self._bufs[q]]
        if not self._heads:
            return empty
        c = self._heads[0][0]
        return [q for q in empty if self._bound[q] < c]

    # -- memory --------------------------------------------------------------------------
    def buffered(self, partition: int) -> int:
        return len(self._bufs[partition])

    def buffered_bytes(self, partition: int | None = None) -> int:
        return sum(self._bytes) if partition is None else self._bytes[partition]

    def room(self, partition: int) -> bool:
        """Whether ``partition`` may buffer more: below its byte share, or empty (a single
        record larger than the share is still taken alone, so the merge always progresses)."""
        return not self._bufs[partition] or self._bytes[partition] < self.share_bytes

    def bound(self, partition: int) -> int:
        return self._bound[partition]


__all__ = ["GlobalMerge", "GlobalOrderViolation"]
