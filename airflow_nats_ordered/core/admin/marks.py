"""The marks of a drain wait and where the wait stands against them.

A group is *drained* up to a set of *marks* (partition -> stream sequence) when every
partition's committed position is at or past its mark. :func:`marks_to_wait` is the one
rule every way of waiting applies (:func:`.drain.wait_drained`, its trigger, the poke-mode
sensor) to decide which marks are compared on a repartitioned stream; :class:`DrainProgress`
is each awaited partition's committed position beside its mark.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream


@dataclass(frozen=True)
class DrainProgress:
    """Where a wait stands: each awaited partition's committed position and mark."""

    marks: Mapping[int, int]
    committed: Mapping[int, int]
    elapsed: float
    #: True while the group has no state yet (no worker has joined it): nothing committed
    group_missing: bool = False
    #: the stream's layout epoch while the group still processes an earlier one (it was
    #: repartitioned and the group has not finished the old partitions); None once reached
    waiting_epoch: int | None = None
    #: the epoch of a layout whose switch point is not recorded yet (a repartition running
    #: or interrupted): the marks are compared once it is (``marks`` is empty meanwhile)
    pending_switch: int | None = None

    @property
    def behind(self) -> dict[int, tuple[int, int]]:
        """Partitions not yet at their mark: ``partition -> (committed, mark)``."""
        return {
            p: (self.committed.get(p, 0), m)
            for p, m in sorted(self.marks.items())
            if self.committed.get(p, 0) < m
        }

    @property
    def done(self) -> bool:
        return not self.behind and self.waiting_epoch is None and self.pending_switch is None


def marks_to_wait(
    marks: Mapping[int, int] | Mapping[str, int],
    *,
    partitions: int,
    switch_seq: int,
    stream: str,
) -> dict[int, int]:
    """The marks a drain wait still compares with commit records of the stream's current
    layout (``partitions`` partitions, last switch point ``switch_seq``; 0 if never
    repartitioned). The one rule for every way of waiting (:func:`~.drain.wait_drained`, its
    trigger, the poke-mode sensor).

    A mark at or below the switch point is of an earlier layout, whatever partition number
    it names (the old layout may have had more partitions): it is met once the group reads
    the current layout, because the group moves only after every earlier partition is
    applied to its last record, so it is left out here and the caller waits for that move.
    A later mark must name a partition of the current layout, else :class:`ConfigError`.
    """
    given = {int(p): int(m) for p, m in marks.items()}
    pending = {p: m for p, m in given.items() if m > switch_seq} if switch_seq else given
    wrong = sorted(p for p in pending if not 0 <= p < partitions)
    if wrong:
        raise ConfigError(
            f"marks name partitions {wrong} but stream {stream} has partitions 0 to "
            f"{partitions - 1}; pass the marks the publisher reported for it"
        )
    return pending


def recorded_switch(described: PartitionedStream) -> int:
    """The last recorded switch point of ``described`` (0 if never repartitioned); a
    pending layout's 0 is no switch point."""
    return max((lay.switch_seq for lay in described.layouts if not lay.pending), default=0)
