"""The seeded generator: which operation to start next, and with what.

Every choice comes from one ``random.Random(seed)``, so a seed names a plan of operations
(the processes' timing still varies from run to run; the history records what happened).
An operation is started only when it makes sense (a producer id is never published twice at
once, at most one repartition runs, ...) and when a skipped known defect does not forbid it
(see :mod:`explore.known`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .world import World

#: every operation, with its weight (how often it is picked among those possible)
OPERATIONS: dict[str, float] = {
    "publish": 3.0,  # CLI publish of a new input (a new producer id)
    "publish-again": 2.0,  # CLI publish of an earlier input, same producer id
    "run": 1.5,  # publish_run (core API) of a new input, in a subprocess
    "run-again": 1.0,  # publish_run of an earlier run, same producer id (resumes)
    "worker-join": 1.5,
    "worker-leave": 0.8,  # SIGTERM: commit, release, exit 0
    "pool-join": 0.5,
    "pool-leave": 0.4,
    "repartition": 0.7,
    "group-reset": 0.5,  # --to earliest --execute: re-delivery, the sink ignores the applied
    "group-rebalance": 0.5,
    "dead-letters-replay": 0.6,
    "dead-letters-purge": 0.3,
    "drain": 1.0,  # status --wait-drained
    "status": 0.5,  # status --json and group list --json
    # --global-order only: a global-read of group gg (a second one fences the first)
    "global-read-join": 1.0,
    "global-read-leave": 0.5,  # SIGTERM: write the position, exit 0
    "global-drain": 0.5,  # status --wait-drained --group gg
}

#: the operations of --global-order only
GLOBAL_OPS = frozenset({"global-read-join", "global-read-leave", "global-drain"})
#: what --global-order leaves out: a global-order stream refuses a repartition, and a
#: dead letter's replay carries no global sequence (it would stop the reader)
NOT_GLOBAL = frozenset({"repartition", "dead-letters-replay", "dead-letters-purge"})
PUBLISHES = ("publish", "publish-again", "run", "run-again")

MAX_WORKERS = 4
MAX_POOLS = 1
MAX_READERS = 2  # a second global reader fences the first


@dataclass(frozen=True)
class Action:
    op: str
    params: dict[str, Any] = field(default_factory=dict)


class Generator:
    """Picks the next operation (see the module)."""

    def __init__(
        self,
        rng: random.Random,
        world: World,
        *,
        enabled: frozenset[str],
        skip_known: frozenset[str],
        poison: bool,
        global_order: bool = False,
    ) -> None:
        self.rng = rng
        self.global_order = global_order
        self.world = world
        self.enabled = enabled
        self.skip = skip_known
        self.poison = poison
        self._names = 0

    def name(self, prefix: str) -> str:
        self._names += 1
        return f"{prefix}-{self._names}"

    def reusable(self, kind: str, running: Mapping[str, int], busy: set[str]) -> list[str]:
        """Producer ids of ``kind`` that may be published again now."""
        out = []
        for p in self.world.producers.values():
            if p.kind != kind or p.id in busy:
                continue
            out.append(p.id)
        return sorted(out)

    def possible(self, running: Mapping[str, int], busy: set[str]) -> dict[str, float]:
        """The operations that may start now, with their weights. ``running``: how many
        commands of each op run; ``busy``: producer ids being published."""
        rep = running.get("repartition", 0)
        workers = running.get("worker-join", 0)
        pools = running.get("pool-join", 0)
        readers = running.get("global-read-join", 0)
        # --global-order: one global-order publisher at a time (the stream's sequencer claim)
        alone = not self.global_order or not any(running.get(op, 0) for op in PUBLISHES)
        ok = {
            "publish": alone,
            "publish-again": alone and bool(self.reusable("cli", running, busy)),
            "run": alone,
            "run-again": alone and bool(self.reusable("run", running, busy)),
            "worker-join": workers < MAX_WORKERS,
            "worker-leave": workers >= 1 and workers + pools >= 2,
            "pool-join": pools < MAX_POOLS,
            "pool-leave": pools >= 1 and workers >= 1,
            "repartition": not rep,
            "group-reset": not running.get("group-reset", 0),
            "group-rebalance": workers + pools >= 1 and not running.get("group-rebalance", 0),
            "dead-letters-replay": self.poison and not running.get("dead-letters-replay", 0),
            "dead-letters-purge": self.poison and not running.get("dead-letters-purge", 0),
            "drain": not running.get("drain", 0),
            "status": not running.get("status", 0),
            "global-read-join": self.global_order and readers < MAX_READERS,
            "global-read-leave": self.global_order and readers >= 1,
            "global-drain": self.global_order and not running.get("global-drain", 0),
        }
        weights = {op: w for op, w in OPERATIONS.items() if op in self.enabled and ok[op]}
        if workers + pools == 0 and "worker-join" in weights:
            weights["worker-join"] *= 6  # a group with no member stays a short while only
        if readers and "global-read-join" in weights:
            weights["global-read-join"] *= 0.3  # a second reader (fencing) now and then
        elif "global-read-join" in weights:
            weights["global-read-join"] *= 3  # no reader stays a short while only
        return weights

    def next(self, running: Mapping[str, int], busy: set[str]) -> Action | None:
        weights = self.possible(running, busy)
        if not weights:
            return None
        ops = sorted(weights)
        op = self.rng.choices(ops, [weights[o] for o in ops])[0]
        return Action(op, self._params(op, running, busy))

    def _params(self, op: str, running: Mapping[str, int], busy: set[str]) -> dict[str, Any]:
        r = self.rng
        if op in ("publish", "run"):
            # now and then a long run, still publishing when a repartition switches
            size = r.choice((20, 50, 120, 300) + ((1500,) if op == "run" else ()))
            share = 0.04 if self.poison else 0.0
            kind = "cli" if op == "publish" else "run"
            prod = self.world.new_input(
                kind, size, share, [r.random() for _ in range(size)], self.name(kind)
            )
            return {"producer": prod.id}
        if op == "publish-again":
            return {"producer": r.choice(self.reusable("cli", running, busy))}
        if op == "run-again":
            return {"producer": r.choice(self.reusable("run", running, busy))}
        if op == "repartition":
            choices = [n for n in range(1, 7) if n != self.world.partitions]
            return {"partitions": r.choice(choices)}
        if op == "group-reset":
            return {"partitions": None if r.random() < 0.6 else "0"}
        if op == "dead-letters-replay":
            return {"purge": r.random() < 0.5}
        if op == "pool-join":
            return {"size": 2, "prefix": self.name("pool")}
        if op == "worker-join":
            return {"member": self.name("w")}
        if op == "global-read-join":
            return {"reader": self.name("gr")}
        return {}
