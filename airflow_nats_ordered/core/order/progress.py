"""How far one partition is done in the event-time mode (:class:`PartitionProgress`): pure.

In the event-time mode a partition's records may be handed over out of stream order (a
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


__all__ = ["PartitionProgress"]
