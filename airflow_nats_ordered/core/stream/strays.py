"""Stray messages: what a partitioned stream holds on subjects that are not partition
subjects of any of its layouts, and how they are reported to an operator (:class:`Strays`).

Guarantees: a report names how many stray messages there are and on which subjects, why no
group will ever process them, and the commands that remove them. :mod:`.partitioned` finds
them (:func:`~.partitioned.stray_messages`; :func:`~.partitioned.stream_contents` counts them
from the same read as the partitions) and purges them (:func:`~.partitioned.purge_strays`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Strays:
    """Messages a stream holds on subjects that are not its partition subjects.

    Only a stream created before the explicit subject list (subjects ``<prefix>.p.*``) can
    have them: a foreign producer published to ``.p.<P>``, ``.p.00``, ``.p.x``... No worker
    reads them, so a group can never process them. ``subjects`` maps each stray subject to
    its message count; ``accepting`` is True while the stream still stores such publishes
    (not yet narrowed by :func:`~.partitioned.provision`).
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
