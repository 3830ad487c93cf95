"""Sticky, cooperative partition assignment: who owns which partition (pure, no I/O).

:func:`assign` maps partitions ``0..P-1`` onto the live members of a group. It guarantees:

* **Coverage** - with at least one member, every partition has exactly one owner, and
  every owner is a live member. With no members, nobody owns anything.
* **Balance** - every member owns ``floor(P/N)`` or ``ceil(P/N)`` partitions (``P < N``
  leaves some members with none, still balanced).
* **Stickiness** - a partition stays with its previous owner while that owner is a member
  and not over its quota. The ``P mod N`` "+1" slots go to the members that keep the most
  of their previous partitions, so as little as possible moves. Consequences, for a
  balanced previous assignment: a member joining a group of N moves at most
  ``ceil(P/(N+1))`` partitions, all of them to the newcomer; a member leaving moves only
  the leaver's partitions; unchanged membership moves nothing.
* **Determinism** - the result depends only on ``P``, the *set* of members and the
  previous assignment (member order and repeats in the input do not matter), so every
  member computing it gets the same answer.
* **Generations** - the generation goes up by one exactly when the owners change; with no
  change the previous :class:`Assignment` is returned as is.

:func:`plan_cooperative` turns two assignments into one member's to-do list: partitions to
release (stop, commit, drop the lease) and partitions to acquire (claim the lease, raise the
fence, start). Releasing before acquiring is what makes a rebalance cooperative: members
keep processing the partitions that do not move.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Version tag of :meth:`Assignment.to_json`; :meth:`Assignment.from_json` refuses others.
FORMAT_VERSION = 1


def _check_member(member: object) -> str:
    if not isinstance(member, str) or not member:
        raise ValueError(f"a member id must be a non-empty string, got {member!r}")
    return member


@dataclass(frozen=True)
class Assignment:
    """One generation of a group's partition ownership.

    ``owners`` maps partition -> member id and is either empty (no members) or covers
    exactly the partitions ``0..P-1`` (checked on construction). Treat it as read-only.
    """

    generation: int
    owners: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        gen = self.generation
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise ValueError(f"generation must be an int >= 0, got {gen!r}")
        if not isinstance(self.owners, Mapping):
            raise ValueError(
                f"owners must be a dict partition -> member id, got {type(self.owners).__name__}"
            )
        owners = dict(self.owners)
        for p, m in owners.items():
            if not isinstance(p, int) or isinstance(p, bool):
                raise ValueError(f"partition numbers must be ints, got {p!r}")
            _check_member(m)
        if owners and set(owners) != set(range(len(owners))):
            missing = sorted(set(range(len(owners))) - set(owners))
            raise ValueError(
                f"owners must cover partitions 0..{len(owners) - 1} exactly once; "
                f"missing {missing[:10]}, have {sorted(owners)[:10]}..."
            )
        object.__setattr__(self, "owners", dict(sorted(owners.items())))

    @property
    def partitions(self) -> int:
        """How many partitions are owned: P when the group has members, else 0."""
        return len(self.owners)

    @property
    def members(self) -> list[str]:
        """The members owning at least one partition, sorted."""
        return sorted(set(self.owners.values()))

    def partitions_of(self, member: str) -> list[int]:
        """The partitions ``member`` owns, ascending (empty if it owns none)."""
        return sorted(p for p, m in self.owners.items() if m == member)

    def to_json(self) -> bytes:
        """Compact, stable encoding: equal assignments give identical bytes.

        ``{"generation":g,"members":[sorted ids],"owners":[member index of p0, p1, ...],"v":1}``
        """
        members = self.members
        index = {m: i for i, m in enumerate(members)}
        doc = {
            "v": FORMAT_VERSION,
            "generation": self.generation,
            "members": members,
            "owners": [index[self.owners[p]] for p in range(self.partitions)],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str) -> Assignment:
        """Decode :meth:`to_json` output; raises ValueError naming what is malformed."""
        try:
            doc: Any = json.loads(data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"assignment is not valid UTF-8 JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"assignment must be a JSON object, got {type(doc).__name__}")
        if doc.get("v") != FORMAT_VERSION:
            raise ValueError(
                f"assignment format version {doc.get('v')!r} is not supported (expected "
                f"{FORMAT_VERSION}); upgrade airflow-nats-ordered on every member"
            )
        missing = {"generation", "members", "owners"} - set(doc)
        if missing:
            raise ValueError(f"assignment is missing field(s) {sorted(missing)}")
        gen, members, owners = doc["generation"], doc["members"], doc["owners"]
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise ValueError(f"assignment generation must be an int >= 0, got {gen!r}")
        if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
            raise ValueError("assignment members must be a list of non-empty strings")
        if len(set(members)) != len(members):
            raise ValueError(f"assignment members contain duplicates: {members}")
        if not isinstance(owners, list):
            raise ValueError("assignment owners must be a list of member indexes")
        for p, i in enumerate(owners):
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(members):
                raise ValueError(
                    f"assignment owner of partition {p} is {i!r}, not an index into the "
                    f"{len(members)} members"
                )
        return cls(gen, {p: members[i] for p, i in enumerate(owners)})


def assign(partitions: int, members: Iterable[str], previous: Assignment | None) -> Assignment:
    """The sticky, balanced assignment of ``partitions`` over ``members`` (see module doc).

    ``previous`` may come from a different partition count: partitions it names beyond
    ``partitions - 1`` are ignored, new ones are treated as unowned.
    """
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
    if isinstance(members, str):
        raise ValueError(f"members must be an iterable of member ids, not the string {members!r}")
    live = sorted({_check_member(m) for m in members})
    before = previous.owners if previous is not None else {}
    gen_before = previous.generation if previous is not None else 0

    owners: dict[int, str] = {}
    if live:
        n = len(live)
        base, extra = divmod(partitions, n)
        kept: dict[str, list[int]] = {m: [] for m in live}
        for p in range(partitions):
            m = before.get(p)
            if m in kept:
                kept[m].append(p)
        # The "+1" slots go to whoever keeps the most of its previous partitions.
        by_kept = sorted(live, key=lambda m: (-len(kept[m]), m))
        quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_kept)}
        freed: list[int] = [p for p in range(partitions) if before.get(p) not in kept]
        for m in live:
            keep = kept[m][: quota[m]]
            freed.extend(kept[m][quota[m] :])
            for p in keep:
                owners[p] = m
        load = {m: min(len(kept[m]), quota[m]) for m in live}
        for p in sorted(freed):
            m = min((m for m in live if load[m] < quota[m]), key=lambda m: (load[m], m))
            owners[p] = m
            load[m] += 1

    if previous is not None and owners == before:
        return previous
    if previous is None and not owners:
        return Assignment(0, {})
    return Assignment(gen_before + 1, owners)


def moves(before: Assignment | None, after: Assignment) -> dict[int, tuple[str | None, str]]:
    """Partitions owned in ``after`` whose owner differs from ``before``: ``p -> (old, new)``.

    ``old`` is None when nobody owned ``p`` before (no previous assignment, no members, or a
    new partition). Partitions that nobody owns in ``after`` are not listed.
    """
    old = before.owners if before is not None else {}
    return {p: (old.get(p), m) for p, m in after.owners.items() if old.get(p) != m}


def plan_cooperative(
    before: Assignment | None, after: Assignment, member: str
) -> tuple[list[int], list[int]]:
    """What ``member`` must do to go from ``before`` to ``after``: ``(to_release, to_acquire)``.

    Both lists are ascending and disjoint; partitions owned in both are in neither (they keep
    running untouched). Release first; acquire a partition only once its previous owner has
    released it (or its lease has expired) - the fencing token protects the sink either way.
    """
    _check_member(member)
    had = set(before.partitions_of(member)) if before is not None else set()
    has = set(after.partitions_of(member))
    return sorted(had - has), sorted(has - had)
