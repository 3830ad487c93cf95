"""How far the global-order reader is done (:class:`ReaderProgress`: what its position
records, kept in memory between writes) and, in the event-time modes, how far one partition
is (:class:`PartitionProgress`): pure.

In the event-time modes a partition's records may be handed over out of stream order (a
producer's event times need not increase along a partition), so "the last record handed
over" is not a resume point. The position keeps two sequences per partition instead
(``docs/protocol.md`` section 12):

* ``prefix`` (``seqs``): every record of the partition up to it is *done* (handed over, or
  set aside by the late-record policy);
* ``horizon`` (``read``): every record in ``(prefix, horizon]`` is done **if and only if**
  its key is at or below the position's key ``(g, tie)`` (or it has no event time: such a
  record is set aside before the horizon may pass it).

Guarantee: :meth:`PartitionProgress.horizon` never passes a record that is not done but has
a key at or below the position's (one held by :meth:`hold`: late, or without a time, while
its policy is applied, or when the reader stopped before it). So a reader that resumes at
``prefix + 1`` skips exactly the done records of ``(prefix, horizon]`` by their key and
treats everything else as it would have before the restart: nothing is handed over twice,
and nothing is skipped.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_nats_ordered.core.group.global_position import GlobalPosition
    from airflow_nats_ordered.core.order.producers import Key


class PartitionProgress:
    """The done records of one partition, read in stream order from ``prefix + 1``."""

    def __init__(self, prefix: int = 0, horizon: int = 0) -> None:
        self.prefix = prefix
        self._read = max(prefix, horizon)
        self._open: deque[int] = deque()  # read, after the prefix, in stream order
        self._done: set[int] = set()  # those of _open that are done
        self._held: set[int] = set()  # not done, key at or below the position's

    def read(self, seq: int) -> None:
        """The next record of the partition was read (not done yet)."""
        self._open.append(seq)
        self._read = max(self._read, seq)

    def hold(self, seq: int) -> None:
        """A record read with a key at or below the position's (late, or without a time):
        the horizon stays before it until it is :meth:`done`."""
        self._held.add(seq)

    def done(self, seq: int) -> None:
        """The record was handed over or set aside."""
        self._held.discard(seq)
        self._done.add(seq)
        while self._open and self._open[0] in self._done:
            self.prefix = self._open.popleft()
            self._done.discard(self.prefix)

    def horizon(self) -> int:
        return min(self._held) - 1 if self._held else self._read

    def open_records(self) -> int:
        """Records read after the prefix and kept track of (done or not)."""
        return len(self._open)


class ReaderProgress:
    """What the reader has done, as its position (:mod:`..group.global_position`) records it:
    the key of the last record handed over (``g``, ``tie``; in the exact event-time mode
    the whole producer key, ``key``), per partition the stream sequence up to which every
    record is done (``seqs``; in the event-time modes with a :class:`PartitionProgress` per
    partition, ``partitions``), the count of late records met (``late``), and how many
    changes were made since the position was last written (``unwritten``).

    The merge strategy moves it as it hands records over or sets them aside; the reader
    writes it."""

    def __init__(
        self,
        g: int = 0,
        seqs: dict[int, int] | None = None,
        *,
        tie: int = 0,
        late: int = 0,
        key: Key | None = None,
        partitions: list[PartitionProgress] | None = None,
    ) -> None:
        self.g = g
        self.tie = tie
        #: the exact event-time mode: the key of the last record handed over, or None
        self.key = key
        self.seqs: dict[int, int] = {} if seqs is None else seqs
        self.late = late
        #: the event-time modes: per partition what is done (records go out of stream order)
        self.partitions = partitions
        self.unwritten = 0

    @classmethod
    def resumed(cls, pos: GlobalPosition, partitions: int, per_partition: bool) -> ReaderProgress:
        """Where the position ``pos`` of a stream of ``partitions`` left off;
        ``per_partition``: keep a :class:`PartitionProgress` per partition (event-time modes)."""
        return cls(
            pos.g,
            dict(pos.seqs),
            tie=pos.tie,
            late=pos.late,
            key=(pos.g, *pos.producer_key) if pos.producer_key else None,
            partitions=[
                PartitionProgress(pos.seqs.get(p, 0), pos.read.get(p, 0)) for p in range(partitions)
            ]
            if per_partition
            else None,
        )

    def done(self, p: int, seq: int) -> None:
        """Record ``seq`` of partition ``p`` as done (handed over or set aside)."""
        if self.partitions is None:
            self.seqs[p] = seq
            return
        progress = self.partitions[p]
        progress.done(seq)
        if progress.prefix:
            self.seqs[p] = progress.prefix

    def horizons(self) -> dict[int, int] | None:
        """The position's ``read``: per partition the horizon (event-time modes), else None."""
        if self.partitions is None:
            return None
        return {p: h for p, pr in enumerate(self.partitions) if (h := pr.horizon())}


__all__ = ["PartitionProgress", "ReaderProgress"]
