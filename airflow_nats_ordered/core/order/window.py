"""The time-window merge (:class:`WindowMerge`) of the global-order reader, for producers
that cannot stamp ``Nats-Global-Seq`` or write watermarks (foreign clients): pure, no I/O.

A record's key is ``(t, stream_seq)``: ``t`` the time the server stored it (nanoseconds
since the epoch, from the delivery's reply subject), the stream sequence (unique in the
stream) breaking ties. Within a partition keys increase with the stream sequence: a stored
time below the partition's previous one (the server's clock stepped back) is raised to it.

Each partition has a **frontier**: while its reader has seen it caught up (a delivery with
nothing pending, or a fetch that found nothing) and reads on, the reader's clock ``now``;
otherwise (not caught up, or not read while its buffer is full) the stored time of its
last record read (0 before the first). The head of the buffered records is released once
``t + lateness <= min(frontiers)``. A record read with a key at or below the last key
released is **late** (:meth:`WindowMerge.add` returns True and keeps it out of the buffer):
the reader applies its late-record policy to it. Records of one partition are still handed
over (or set aside) in stream order, so a partition's handled records are a prefix of it.

What is guaranteed (the bound, ``docs/architecture/order.md``, *Time-window mode*): a record is
late only if it reached the reader more than ``lateness`` after the server stored it, as
the reader's clock tells (so the reader's clock running ahead of the server's counts
against the window, one behind adds to it). Nothing else is late, and the on-time records
are handed over in exactly ``(t, stream_seq)`` order.

The event-time mode (:meth:`WindowMerge.add_event`) keys a record by ``(e, stream_seq)``,
``e`` the producer's event time from a header, and keeps the frontiers above (stored time,
reader's clock). A partition's future records are stored after its frontier, so a record
is late there only if it was stored (or reached the reader) more than ``lateness`` after
its event time, by the producer's clock against the server's (or the reader's).
"""

from __future__ import annotations

import heapq
from typing import Any

from airflow_nats_ordered.core.errors import NatsOrderedError

#: the late-record policies of the time-window mode
LATE_POLICIES = ("dead-letter", "block", "flag")


class LateRecordError(NatsOrderedError):
    """A late record with ``late="block"``: the reader stopped before it."""

    def __init__(self, message: str, partition: int, seq: int) -> None:
        super().__init__(message)
        self.partition = partition
        self.seq = seq


def stored_time_ns(reply: str) -> int:
    """The stored time (ns since the epoch) and, via :func:`pending`, the consumer's pending
    count, from a JetStream delivery's reply subject (both ACK subject formats)."""
    t = reply.split(".")
    return int(t[7]) if len(t) == 9 else int(t[9])


def pending(reply: str) -> int:
    t = reply.split(".")
    return int(t[8]) if len(t) == 9 else int(t[10])


class WindowMerge:
    """Merges ``partitions`` inputs by ``(stored time, stream seq)`` with a window of
    ``lateness_ns``. ``after``: the last key released before (a resumed position)."""

    def __init__(
        self,
        partitions: int,
        lateness_ns: int,
        after: tuple[int, int] = (0, 0),
        share_bytes: int = 1 << 62,
    ) -> None:
        self.partitions = partitions
        self.lateness_ns = lateness_ns
        self.released = after
        self.share_bytes = max(1, share_bytes)
        self._heap: list[tuple[int, int, int, Any, int]] = []  # (t, seq, p, item, size)
        self._bytes = [0] * partitions
        self._count = [0] * partitions
        self._last_t = [0] * partitions  # the last stored time read per partition
        self._caught_up = [False] * partitions

    def key(self, partition: int, t: int, seq: int) -> tuple[int, int]:
        """The key of the next record of ``partition`` (stored time ``t``, stream seq)."""
        return (max(t, self._last_t[partition]), seq)

    def add(self, partition: int, t: int, seq: int, item: Any, size: int, caught_up: bool) -> bool:
        """Read the next record of ``partition``; True if it is late (not buffered: the
        caller applies the policy). ``caught_up``: nothing was pending after it."""
        k = self.key(partition, t, seq)
        self._last_t[partition] = k[0]
        self._caught_up[partition] = caught_up
        if k <= self.released:
            return True
        heapq.heappush(self._heap, (k[0], k[1], partition, item, size))
        self._bytes[partition] += size
        self._count[partition] += 1
        return False

    def add_event(
        self,
        partition: int,
        key: tuple[int, int],
        stored_t: int,
        item: Any,
        size: int,
        caught_up: bool,
    ) -> bool:
        """The event-time mode's :meth:`add`: ``key`` is ``(event time, stream seq)`` as the
        producer stamped it, not raised (a partition's records may come in any event-time
        order: the heap sorts them); the partition's frontier still follows the stored time
        ``stored_t`` (raised as in :meth:`add`). True if the record is late."""
        self.seen(partition, stored_t, caught_up)
        if key <= self.released:
            return True
        heapq.heappush(self._heap, (key[0], key[1], partition, item, size))
        self._bytes[partition] += size
        self._count[partition] += 1
        return False

    def seen(self, partition: int, stored_t: int, caught_up: bool) -> None:
        """A record of ``partition`` stored at ``stored_t`` was read but is not buffered (done
        before a restart, or without an event time): its frontier moves on all the same."""
        self._last_t[partition] = max(stored_t, self._last_t[partition])
        self._caught_up[partition] = caught_up

    def idle(self, partition: int) -> None:
        """A fetch of ``partition`` found nothing: it is caught up."""
        self._caught_up[partition] = True

    def stalled(self, partition: int) -> None:
        """``partition`` is not read while its buffer is full: what it stored meanwhile is
        unread, so its frontier falls back to the stored time of its last record read."""
        self._caught_up[partition] = False

    def frontier(self, now_ns: int) -> int:
        return min(now_ns if c else t for c, t in zip(self._caught_up, self._last_t, strict=True))

    def pop(self, now_ns: int) -> tuple[int, tuple[int, int], Any] | None:
        """The next record as ``(partition, key, item)`` once the window has passed it."""
        if not self._heap or self._heap[0][0] + self.lateness_ns > self.frontier(now_ns):
            return None
        t, seq, p, item, size = heapq.heappop(self._heap)
        self._bytes[p] -= size
        self._count[p] -= 1
        self.released = (t, seq)
        return p, (t, seq), item

    def wait_ns(self, now_ns: int) -> int | None:
        """Nanoseconds until the head could be released by the clock alone (None: nothing
        buffered)."""
        if not self._heap:
            return None
        return max(0, self._heap[0][0] + self.lateness_ns - now_ns)

    def room(self, partition: int) -> bool:
        return not self._count[partition] or self._bytes[partition] < self.share_bytes

    def buffered(self, partition: int) -> int:
        return self._count[partition]


__all__ = ["LATE_POLICIES", "LateRecordError", "WindowMerge", "pending", "stored_time_ns"]
