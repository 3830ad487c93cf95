"""A run that spans a repartition (see :mod:`.runs` and :mod:`.repartition`).

A run's recorded positions (``acked_per_partition``: the first n records of each partition,
in input order) are positions in the layout the run was begun on. When the stream is
repartitioned before the run completes, the next attempt carries them over as
``before_switch`` (the old epoch, its partition count and the positions) and passes over
exactly the records the old layout stored, recomputing each record's old partition with
the partition function; the rest is published on the new layout under new positions.
Every key's records stay in input order: what the old layout stored of a key is a prefix
of the key's records (a partition stores a prefix of what it is sent), and a group reads
the old layout before the new one.

Keyless records are spread round-robin when accepted, so their old positions cannot be
recomputed: a run with keyless records that spans a switch may store some of them twice
(with caller msg-ids inside the duplicate window, none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

from .partitioning import partition_for


async def passing_over_old_layout(
    records: Iterable[Any] | AsyncIterable[Any], partitions: int, stored: Mapping[int, int]
) -> AsyncIterator[Any]:
    """``records`` without those the old layout of ``partitions`` partitions stored:
    per old partition, its first ``stored[p]`` keyed records."""
    seen: Counter[int] = Counter()

    def keep(rec: Any) -> bool:
        key = rec.key
        if key is None or key == "" or key == b"":
            return True
        try:
            p = partition_for(key, partitions)
        except (TypeError, ValueError):
            return True  # refused when published, as before
        seen[p] += 1
        return seen[p] > stored.get(p, 0)

    if isinstance(records, AsyncIterable):
        async for rec in records:
            if keep(rec):
                yield rec
    else:
        for rec in records:
            if keep(rec):
                yield rec
