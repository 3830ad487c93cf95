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
* **Cordon** - cordoned members own nothing; only their partitions move (plus what balance
  over the remaining members needs).
* **Load balance** - with per-partition ``weights`` (measured load: a skewed stream is very
  uneven by count), no member carries more than the average load plus the heaviest
  partition, a member within that bound keeps everything it has, and recomputing with the
  same inputs moves nothing (so the leader's periodic recomputation never churns).

:func:`plan_cooperative` turns two assignments into one member's to-do list: partitions to
release (stop, commit, drop the lease) and partitions to acquire (claim the lease, raise the
fence, start). Releasing before acquiring is what makes a rebalance cooperative: members
keep processing the partitions that do not move.
"""

from __future__ import annotations

import json
import math
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


def assign(
    partitions: int,
    members: Iterable[str],
    previous: Assignment | None,
    *,
    weights: Mapping[int, float] | None = None,
    cordon: Iterable[str] = (),
    slack: float | None = None,
) -> Assignment:
    """The sticky, balanced assignment of ``partitions`` over ``members`` (see module doc).

    ``previous`` may come from a different partition count: partitions it names beyond
    ``partitions - 1`` are ignored, new ones are treated as unowned.

    ``cordon``: members that must own nothing (maintenance); their partitions move, the
    other members' partitions stay where they are as far as balance allows. Cordoning every
    live member is refused (nobody would process anything).

    ``weights``: per-partition load (e.g. measured messages/s); balance is then by load, not
    by count (see :func:`_assign_weighted` for the guarantees). ``slack`` (with weights only)
    is how far above the average load a member may stay without giving anything up; the
    default, the heaviest partition's weight, is what makes a weighted assignment a fixed
    point (recomputing it with the same inputs moves nothing). A smaller slack balances more
    tightly at the cost of more moves: use it for an explicit rebalance.
    """
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
    if isinstance(members, str):
        raise ValueError(f"members must be an iterable of member ids, not the string {members!r}")
    if isinstance(cordon, str):
        raise ValueError(f"cordon must be an iterable of member ids, not the string {cordon!r}")
    everyone = {_check_member(m) for m in members}
    cordoned = {_check_member(m) for m in cordon}
    live = sorted(everyone - cordoned)
    if everyone and not live:
        raise ValueError(
            f"cordoning every live member ({', '.join(sorted(everyone))}) would leave nobody "
            "to process the partitions; cordon fewer members or add one first"
        )
    before = previous.owners if previous is not None else {}
    gen_before = previous.generation if previous is not None else 0

    owners: dict[int, str] = {}
    if live and weights is not None:
        owners = _assign_weighted(partitions, live, before, _weights(partitions, weights), slack)
    elif live:
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


def _weights(partitions: int, weights: Mapping[int, float]) -> list[float]:
    """One finite, non-negative weight per partition. Partitions without a weight (new ones,
    say) count as the average partition; every partition costs at least 1% of the average,
    so idle partitions still spread over the members."""
    given: dict[int, float] = {}
    for p, w in weights.items():
        if not isinstance(p, int) or isinstance(p, bool):
            raise ValueError(f"weights must map partition numbers (ints) to loads, got key {p!r}")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise ValueError(f"the weight of partition {p} must be a finite number >= 0, got {w!r}")
        if 0 <= p < partitions:
            given[p] = float(w)
    mean = sum(given.values()) / len(given) if given else 1.0
    floor = (mean or 1.0) * 0.01
    return [given.get(p, mean) + floor for p in range(partitions)]


def _assign_weighted(
    partitions: int,
    live: list[str],
    before: Mapping[int, str],
    w: list[float],
    slack: float | None,
) -> dict[int, str]:
    """Balance by load, moving as little as possible.

    With ``T`` the average load per member and ``cap = T + slack`` (slack defaults to the
    heaviest weight): each member keeps its previous partitions, heaviest first, as long as
    they fit under ``cap`` (its heaviest one always stays); the rest, and unowned
    partitions, go heaviest first to the least loaded member (LPT). Guarantees: no member's
    load exceeds ``T + max weight`` (no assignment can beat ``max(T, max weight)``); a
    member at or under ``cap`` gives nothing up; with the default slack the result is a
    fixed point.
    """
    if slack is not None and (not math.isfinite(slack) or slack < 0):
        raise ValueError(f"slack must be a finite number >= 0, got {slack!r}")
    target = sum(w) / len(live)
    cap = target + (max(w) if slack is None else slack)
    load = dict.fromkeys(live, 0.0)
    owners: dict[int, str] = {}
    freed: list[int] = []
    kept: dict[str, list[int]] = {m: [] for m in live}
    for p in range(partitions):
        m = before.get(p)
        if m in kept:
            kept[m].append(p)
        else:
            freed.append(p)
    for m in live:
        for p in sorted(kept[m], key=lambda q: (-w[q], q)):
            # its heaviest partition always stays: whoever owned it would be over the cap
            if not load[m] or load[m] + w[p] <= cap * (1 + 1e-12):
                owners[p] = m
                load[m] += w[p]
            else:
                freed.append(p)
    for p in sorted(freed, key=lambda q: (-w[q], q)):
        m = min(live, key=lambda x: (load[x], x))
        owners[p] = m
        load[m] += w[p]
    return owners


def member_loads(
    assignment: Assignment, weights: Mapping[int, float], members: Iterable[str] = ()
) -> dict[str, float]:
    """Each member's total load under ``weights`` (unweighted partitions count 0): the
    owning members, plus ``members`` that own nothing (a cordoned or idle member)."""
    out: dict[str, float] = {m: 0.0 for m in (*assignment.members, *members)}
    for p, m in assignment.owners.items():
        out[m] += float(weights.get(p, 0.0))
    return out


def imbalance(
    assignment: Assignment, weights: Mapping[int, float], members: Iterable[str] = ()
) -> float:
    """Heaviest member's load over the average member's (1.0 is perfect; 1.0 when idle),
    counting ``members`` that own nothing as members with no load."""
    loads = member_loads(assignment, weights, members)
    total = sum(loads.values())
    if not loads or total <= 0:
        return 1.0
    return max(loads.values()) / (total / len(loads))


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
