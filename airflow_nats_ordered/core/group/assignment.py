"""What the leader decides: the group's assignment record and its rebalance policy.

Guarantees: both live in the state bucket (keys ``assignment`` and ``policy``) and are only
ever written by compare-and-set on the revision the writer read (``last=0``: must not
exist yet), so two would-be leaders cannot overwrite each other's plan: the loser gets None
and reads again. :class:`GroupAssignment` holds these verbs; :class:`~.store.GroupStore` has
one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.stream.kv import compact_json
from airflow_nats_ordered.core.stream.layout import state_key


@dataclass
class RebalancePolicy:
    """What the leader balances by, kept in the state bucket (key ``policy``).

    ``cordon``: members that get no partitions; ``weights``: per-partition load (balance by
    load, not count); ``slack``: how far above the average load a member may stay, used once
    for the request ``request`` (an explicit rebalance), after which the leader's periodic
    recomputation uses the default (a fixed point, so nothing churns). ``applied`` is the
    last request the leader has applied, ``error`` why it could not obey it, if so."""

    cordon: list[str] = field(default_factory=list)
    weights: dict[int, float] = field(default_factory=dict)
    slack: float | None = None
    request: str = ""
    applied: str = ""
    #: why the leader could not obey the request it applied last ("" if it did)
    error: str = ""

    @property
    def pending(self) -> bool:
        return bool(self.request) and self.request != self.applied

    def to_json(self) -> bytes:
        d = asdict(self)
        d["weights"] = {str(p): w for p, w in self.weights.items()}
        return compact_json(d)

    @classmethod
    def from_json(cls, data: bytes | None) -> RebalancePolicy:
        d = json.loads(data or b"{}")
        return cls(
            cordon=[str(m) for m in d.get("cordon", [])],
            weights={int(p): float(w) for p, w in (d.get("weights") or {}).items()},
            slack=d.get("slack"),
            request=d.get("request", ""),
            applied=d.get("applied", ""),
            error=d.get("error", ""),
        )


class GroupAssignment:
    """The assignment and policy verbs on a group's state bucket ``state``.

    ``epoch`` gives the layout epoch the group works on now (each epoch has its own
    assignment, ``e<k>.assignment``): the store's, which moves when the group moves to
    another layout."""

    def __init__(self, state: KeyValue, epoch: Callable[[], int]) -> None:
        self.state = state
        self.epoch = epoch

    async def read_assignment(self) -> tuple[bytes | None, int]:
        try:
            e = await self.state.get(state_key(self.epoch(), "assignment"))
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        return e.value, e.revision or 0

    async def write_assignment(self, data: bytes, last: int) -> int | None:
        try:
            key = state_key(self.epoch(), "assignment")
            if last == 0:
                return await self.state.create(key, data)
            return await self.state.update(key, data, last=last)
        except KeyWrongLastSequenceError:
            return None

    async def read_policy(self) -> tuple[RebalancePolicy, int]:
        """The rebalance policy and its revision (an empty policy, revision 0, if none)."""
        try:
            e = await self.state.get("policy")
        except (KeyNotFoundError, KeyDeletedError):
            return RebalancePolicy(), 0
        return RebalancePolicy.from_json(e.value), e.revision or 0

    async def write_policy(self, policy: RebalancePolicy, last: int) -> int | None:
        """Write the policy by CAS on ``last`` (0: it must not exist); None if it changed."""
        try:
            if last == 0:
                return await self.state.create("policy", policy.to_json())
            return await self.state.update("policy", policy.to_json(), last=last)
        except KeyWrongLastSequenceError:
            return None
