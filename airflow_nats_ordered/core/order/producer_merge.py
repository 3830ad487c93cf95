"""The exact merge of several producers' records by event time (:class:`ProducerMerge`):
pure, no I/O. The reader side of :mod:`.producer`.

Records come from the partitions in any interleaving, each with its key ``(event time,
producer, epoch, n)`` (:mod:`.producers`). For each registered producer the merge
keeps a **bound**: a key no record of that producer not yet buffered is at or below (its
confirmed watermark), ``None`` while it promised nothing, or closed (nothing more of that
registration, its epoch, comes; a record of a later epoch is a new registration of the id,
e.g. the next run of a task, and waits for it like any producer not known yet).

Guarantee: :meth:`ProducerMerge.pop` hands out buffered records in strictly increasing key
order, and hands out the smallest ``c`` only when every registered producer that is not
closed has a bound ``>= c``, and every producer with a buffered record is registered (or
closed): nothing smaller than ``c`` can still arrive, so the order is
exact, never guessed. A producer with no bound, or a bound below ``c``, holds the merge
back (:meth:`holders`). Input that breaks the premises (a key at or below one handed out,
the same key twice, a record of an epoch confirmed closed) is refused with
:class:`GlobalOrderViolation` and changes nothing.
"""

from __future__ import annotations

import heapq
from typing import Any

from airflow_nats_ordered.core.order.merge import GlobalOrderViolation
from airflow_nats_ordered.core.order.producers import Key, show_time


def describe_key(key: Key) -> str:
    return f"(event time {show_time(key[0])}, producer {key[1]}, seq {key[2]}.{key[3]})"


class ProducerMerge:
    """Merges records by key; ``after``: the last key handed out before (a resumed
    position), or None."""

    def __init__(self, partitions: int, after: Key | None = None, share_bytes: int = 1 << 62):
        self.released = after
        self.share_bytes = max(1, share_bytes)
        self._heap: list[tuple[Key, int, Any, int]] = []
        self._bytes = [0] * partitions
        self._count = [0] * partitions
        #: registered producers: their bound (None: nothing promised yet)
        self.bounds: dict[str, Key | None] = {}
        #: closed producers: the epoch their closed mark closed (later epochs: a new
        #: registration of the id)
        self.closed: dict[str, int] = {}
        self._per_epoch: dict[tuple[str, int], int] = {}  # buffered records per registration

    def add(self, partition: int, key: Key, item: Any, size: int, where: str = "") -> None:
        """Buffer a record of ``partition`` with ``key``; ``where`` names it in a violation
        (default: its partition)."""
        where = where or f"partition {partition}"
        if key[1] in self.closed and key[2] <= self.closed[key[1]]:
            raise GlobalOrderViolation(
                f"{where}: a record of producer {key[1]} {describe_key(key)} was "
                f"stored after that producer was closed at epoch {self.closed[key[1]]} (it "
                "closed, or an operator closed it, and then that instance published again; a "
                "restart with the same id publishes in a new epoch): the reader stops before it",
                partition,
            )
        if self.released is not None and key <= self.released:
            raise GlobalOrderViolation(
                f"{where}: a record {describe_key(key)} arrived after "
                f"{describe_key(self.released)} was handed over: its producer broke its "
                "watermark promise (or published event times out of order, or two instances "
                "ran with one producer id); the reader stops before it rather than reorder",
                partition,
            )
        heapq.heappush(self._heap, (key, partition, item, size))
        self._bytes[partition] += size
        self._count[partition] += 1
        self._per_epoch[key[1], key[2]] = self._per_epoch.get((key[1], key[2]), 0) + 1

    def set_marks(self, bounds: dict[str, Key | None], closed: dict[str, int]) -> None:
        """The registered producers as confirmed by the reader (see docs/architecture/order.md):
        ``bounds`` of the open ones, ``closed`` the closed ones with the epoch their closed
        mark closed. Bounds never go down."""
        for p, b in bounds.items():
            old = self.bounds.get(p)
            self.bounds[p] = b if old is None or (b is not None and b > old) else old
        for p in list(self.bounds):
            if p not in bounds:
                del self.bounds[p]
        self.closed = dict(closed)

    def holders(self) -> list[str]:
        """The producers that keep the smallest buffered record (or, with nothing buffered,
        anything) from being handed out."""
        c = self._heap[0][0] if self._heap else None
        held = {p for p, b in self.bounds.items() if b is None or (c is not None and b < c)}
        return sorted(held | self.unknown())

    def unknown(self) -> set[str]:
        """Producers of buffered records that are neither registered nor closed (as far as
        the reader has confirmed): they hold the merge back, since their records not read
        yet may be smaller than the head."""
        return {
            p
            for p, epoch in self._per_epoch
            if p not in self.bounds and (p not in self.closed or epoch > self.closed[p])
        }

    def pop(self) -> tuple[int, Key, Any] | None:
        """The next record as ``(partition, key, item)``, or None while it is not known."""
        if not self._heap:
            return None
        c, p, item, size = self._heap[0]
        if self.unknown():
            return None  # a producer not known yet (its registration is read next)
        for b in self.bounds.values():
            if b is None or b < c:
                return None
        heapq.heappop(self._heap)
        if self._heap and self._heap[0][0] == c:
            heapq.heappush(self._heap, (c, p, item, size))  # changes nothing
            raise GlobalOrderViolation(
                f"two records with the key {describe_key(c)} (partitions {p} and "
                f"{self._heap[0][1]}): two instances published with one producer id; the "
                "reader stops before them",
                p,
            )
        self._bytes[p] -= size
        self._count[p] -= 1
        left = self._per_epoch[c[1], c[2]] - 1
        if left:
            self._per_epoch[c[1], c[2]] = left
        else:
            del self._per_epoch[c[1], c[2]]
        self.released = c
        return p, c, item

    def room(self, partition: int) -> bool:
        return not self._count[partition] or self._bytes[partition] < self.share_bytes

    def buffered(self) -> int:
        return len(self._heap)


__all__ = ["ProducerMerge", "describe_key"]
