"""The nemesis: faults at random instants, from the same seeded generator of choices.

* ``kill``: SIGKILL a running command (a publisher, publish_run, a worker, a pool or one of
  its members, a repartition, a group or dead-letter command); a third of the repartitions
  are also aimed at, at a random instant of their run;
* ``pause``: SIGSTOP it (its whole process group) for a while, then SIGCONT: a stopped
  worker's leases expire meanwhile and it wakes up a zombie;
* ``server-restart``: restart the nats-server (single-server mode), gracefully or by SIGKILL;
* ``leader-kill``: on a 3-node cluster, SIGKILL the stream's leader (or another node) and
  start it again after a while.

Some repartitions are also run with ``NATS_ORDERED_REPARTITION_CRASH_AT`` set to one of
its named crash points (:meth:`Nemesis.crash_repartition_at`): the command SIGKILLs itself
exactly between two of its steps, which random kills hit only rarely. The generator's next
repartition (or the final phase) completes it, as an operator would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: fault kinds and their weights
FAULTS = {"kill": 3.0, "pause": 2.0, "server-restart": 0.6, "leader-kill": 0.8}


@dataclass(frozen=True)
class Fault:
    kind: str
    command: int | None = None  # target command id
    member: bool = False  # kill: one member of a pool, not the pool
    duration: float = 0.0  # pause: how long; leader-kill: how long the node stays down
    hard: bool = False  # server-restart: SIGKILL rather than SIGTERM


class Nemesis:
    """Picks faults (see the module). ``rate``: faults per second on average."""

    def __init__(
        self,
        rng: random.Random,
        *,
        rate: float,
        cluster: bool,
        enabled: frozenset[str],
        skip_known: frozenset[str],
    ) -> None:
        self.rng = rng
        self.rate = rate
        self.cluster = cluster
        self.enabled = enabled
        self.skip = skip_known

    def next(self, dt: float, targets: Sequence[tuple[int, str]]) -> Fault | None:
        """A fault to inject now (``dt``: seconds since the last call), or None.
        ``targets``: the running commands (id, op) that may be hit."""
        r = self.rng
        if r.random() >= self.rate * dt:
            return None
        hittable = list(targets)
        weights = {}
        for kind, w in FAULTS.items():
            if kind not in self.enabled:
                continue
            if kind in ("kill", "pause") and not hittable:
                continue
            if kind == "server-restart" and self.cluster:
                continue
            if kind == "leader-kill" and not self.cluster:
                continue
            weights[kind] = w
        if not weights:
            return None
        kinds = sorted(weights)
        kind = r.choices(kinds, [weights[k] for k in kinds])[0]
        if kind == "kill":
            c, op = r.choice(hittable)
            return Fault("kill", c, member=op == "pool-join" and r.random() < 0.6)
        if kind == "pause":
            c, _ = r.choice(hittable)
            return Fault("pause", c, duration=r.choice((0.5, 1.5, 3.0, 6.0)))
        if kind == "server-restart":
            return Fault("server-restart", hard=r.random() < 0.5)
        return Fault("leader-kill", duration=r.choice((1.0, 3.0, 8.0)))

    def aim_at_repartition(self) -> float | None:
        """A repartition just started: seconds after which to SIGKILL it (a random instant
        of its run, so that some land between its steps), or None. A repartition takes a
        few seconds, too short for the random faults to hit it often."""
        if "kill" not in self.enabled:
            return None
        if self.rng.random() >= 0.35:
            return None
        return self.rng.uniform(0.5, 6.0)

    def aim_at_global_publish(self) -> float | None:
        """A global-order publish (``--global-order``) just started: seconds after which to
        SIGKILL it, or None. Killed, it leaves the stream's sequencer claim behind (the next
        publishes are refused until it lapses, then take it over) and global sequences
        stamped on records it never stored."""
        if "kill" not in self.enabled or self.rng.random() >= 0.25:
            return None
        return self.rng.uniform(0.4, 1.6)

    def crash_repartition_at(self, points: Sequence[str]) -> str | None:
        """A repartition is about to start: the named crash point (one of ``points``) at
        which it kills itself, or None (a third of them crash)."""
        if "kill" not in self.enabled or self.rng.random() >= 0.33:
            return None
        return self.rng.choice(list(points))
