"""Stray messages: what a partitioned stream holds on subjects that are not partition
subjects of any of its layouts (see :mod:`.partitioned`). Split out of :mod:`.partitioned`, which
re-exports every name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.stream.layout import partition_of

if TYPE_CHECKING:
    from airflow_nats_ordered.core.stream.partitioned import PartitionedStream


@dataclass(frozen=True)
class Strays:
    """Messages a stream holds on subjects that are not its partition subjects.

    Only a stream created before the explicit subject list (subjects ``<prefix>.p.*``) can
    have them: a foreign producer published to ``.p.<P>``, ``.p.00``, ``.p.x``... No worker
    reads them, so a group can never process them. ``subjects`` maps each stray subject to
    its message count; ``accepting`` is True while the stream still stores such publishes
    (not yet narrowed by :func:`provision`).
    """

    stream: str
    partitions: int
    subjects: Mapping[str, int] = field(default_factory=dict)
    accepting: bool = False

    @property
    def messages(self) -> int:
        return sum(self.subjects.values())

    def __bool__(self) -> bool:
        return self.messages > 0

    def purge_commands(self) -> list[str]:
        """How to remove them: this tool's own command first, then the ``nats`` CLI's."""
        return [
            f"nats-ordered provision --stream {self.stream} --partitions {self.partitions} "
            "--purge-strays"
        ] + [f"nats stream purge {self.stream} --subject {s} --force" for s in self.subjects]

    def problem(self) -> str:
        """One sentence: how many, where, why they matter and what to do."""
        if not self:
            return ""
        shown = ", ".join(f"{s} ({n})" for s, n in list(self.subjects.items())[:5])
        more = f" and {len(self.subjects) - 5} more subjects" if len(self.subjects) > 5 else ""
        why = (
            "the stream still stores such publishes (it was created with the wildcard "
            f"subject); `nats-ordered provision --stream {self.stream} --partitions "
            f"{self.partitions}` narrows it to its partition subjects so the server refuses them"
            if self.accepting
            else "they were stored before the stream's subjects were narrowed to its "
            "partition subjects"
        )
        return (
            f"stream {self.stream} holds {self.messages} stray message(s) on subjects that are "
            f"not partition subjects (partitions are 0 to {self.partitions - 1}): {shown}{more}. "
            f"No worker reads them, so no group ever processes them; {why}. Republish what is "
            f"needed with a key, then remove them: `{self.purge_commands()[0]}`"
        )


async def stray_messages(nc: NATS, stream: PartitionedStream) -> Strays:
    """The stream's stray messages, from one stream-info read (no per-partition reads)."""
    info = await nc.jetstream().stream_info(stream.name, subjects_filter=">")
    return _strays_in(stream, info.state.subjects or {})


def _strays_in(stream: PartitionedStream, counts: Mapping[str, int]) -> Strays:
    """The strays among a stream's per-subject counts (every stored subject)."""
    return Strays(
        stream.name,
        stream.partitions,
        {s: int(n) for s, n in sorted(counts.items()) if n and not _layout_subject(stream, s)},
        accepting=not stream.explicit_subjects,
    )


def _layout_subject(stream: PartitionedStream, subject: str) -> bool:
    """True when ``subject`` is a partition subject of the stream's current layout or of
    an earlier one (messages of an earlier layout are read by groups that have not yet
    passed its switch; they are no strays)."""
    cur = stream.at_epoch(stream.current_epoch)
    return any(
        partition_of(stream.prefix, lay.epoch, lay.partitions, subject) is not None
        for lay in (*stream.layouts, cur.layout)
    )


async def purge_strays(nc: NATS, stream: PartitionedStream | str) -> Strays:
    """Remove every stray message; returns what was removed. The partitions are untouched:
    each purge names one stray subject (a literal subject, never a wildcard). Narrow the
    stream first (:func:`provision`), or new strays may arrive right after."""
    if isinstance(stream, str):
        from airflow_nats_ordered.core.stream.partitioned import describe

        stream = await describe(nc, stream)
    strays = await stray_messages(nc, stream)
    js = nc.jetstream()
    for subject in strays.subjects:
        await js.purge_stream(strays.stream, subject=subject)
    return strays
