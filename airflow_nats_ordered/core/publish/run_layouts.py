"""A run that spans a repartition (see :mod:`.runs` and :mod:`..stream.repartition`).

A run's recorded positions (``acked_per_partition``: the first n records of each partition,
in input order) are positions in the layout the run was begun on. When the stream is
repartitioned before the run completes, the next attempt carries them over as
``before_switch`` (the old epoch, its partition count and the positions) and its publisher
passes over exactly the records the old layout stored (:class:`OldLayout`): each record's
old partition follows from the input alone (a keyed record's from its key, a keyless one's
from its turn in the publisher's round-robin, which counts every keyless record in call
order), and the publisher counts old positions where it took them, after its refusals, so
a record refused then is refused again and takes no old position. The rest is published on
the new layout under new positions. Every key's records stay in input order: what the old
layout stored of a key is a prefix of the key's records (a partition stores a prefix of what
it is sent), and a group reads the old layout before the new one.

Whatever the recorded positions miss (an attempt killed between two progress records,
another producer's message after the run's last one) is sent again under the msg-id it had:
a derived msg-id holds the record's place in the input, not its partition (``docs/protocol.md``
section 6), so inside the stream's duplicate window the server stores it once.
"""

from __future__ import annotations

from collections.abc import Mapping

import mmh3

from airflow_nats_ordered.core.stream.partitioning import HASH_SEED


class OldLayout:
    """What the layout a run was begun on stored of it: per old partition, its first
    ``stored[p]`` records (as that layout numbered them). :meth:`stored` tells, record by
    record in input order, whether the old layout holds it."""

    __slots__ = ("partitions", "_left")

    def __init__(self, partitions: int, stored: Mapping[int, int]) -> None:
        if partitions < 1:
            raise ValueError(f"an old layout has at least 1 partition, got {partitions}")
        self.partitions = partitions
        self._left = [max(0, int(stored.get(p, 0))) for p in range(partitions)]

    def stored(self, key: bytes, turn: int) -> bool:
        """Whether the old layout stored the next record it would have accepted: ``key``
        its key bytes (empty: keyless, then ``turn`` is its round-robin turn, 0-based)."""
        if key:
            p = mmh3.hash(key, HASH_SEED, signed=False) % self.partitions
        else:
            p = turn % self.partitions
        left = self._left[p]
        if left:
            self._left[p] = left - 1
            return True
        return False

    @property
    def left(self) -> int:
        """Records the old layout stored that are still to be passed over."""
        return sum(self._left)
