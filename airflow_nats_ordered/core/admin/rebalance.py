"""Rebalancing a consumer group on request: asking its leader for a new assignment (moving
partitions off cordoned members, or balancing by load) and waiting until it has settled;
and the per-partition message rates a rebalance by load weighs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api

from airflow_nats_ordered.core.admin.membership import live_members
from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.group.assignment import RebalancePolicy
from airflow_nats_ordered.core.group.assignor import Assignment, assign, imbalance, moves
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.core.worker.epochs import group_layout


@dataclass(frozen=True)
class Rebalanced:
    """What :func:`rebalance_group` did: the moves ``partition -> (old owner, new owner)``,
    the generation in force, and (with weights) the imbalance before and after."""

    stream: str
    group: str
    generation: int
    moves: dict[int, tuple[str | None, str]]
    owners: dict[int, str]
    imbalance_before: float | None
    imbalance_after: float | None
    settled_in: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "group": self.group,
            "generation": self.generation,
            "moves": {str(p): {"from": a, "to": b} for p, (a, b) in self.moves.items()},
            "owners": {str(p): m for p, m in self.owners.items()},
            "imbalance_before": self.imbalance_before,
            "imbalance_after": self.imbalance_after,
            "settled_in": round(self.settled_in, 3),
        }


async def rebalance_group(
    nc: NATS,
    stream: str,
    group: str,
    *,
    cordon: Sequence[str] = (),
    weights: Mapping[int, float] | None = None,
    slack: float | None = 0.0,
    timeout: float = 60.0,
) -> Rebalanced:
    """Ask the group's leader for a new assignment now and wait until it has settled
    (every partition's lease held by its assigned owner).

    ``cordon``: members to take every partition away from (before maintenance); it stays in
    force until the next rebalance request without them, so a request that adds a member to
    the cordon names the ones already cordoned again. Each id must be a member the group
    knows (see :func:`check_cordon`): a live one, or one that is not live but owns
    partitions in the assignment in force or is cordoned by the request in force (stopped
    for its maintenance: it stays cordoned, and gets nothing when it comes back). Any other
    id (a typo, another deployment's member id) is refused with a :class:`ConfigError`
    naming the group's live members, before anything is written.

    ``weights``: per-partition load (e.g. :func:`partition_rates`); movement stays minimal
    for the given ``slack`` (how far above the average load a member may stay; 0 balances
    as tightly as the weights allow). A weight for a partition that neither the group's
    layout nor the stream's current one has is refused (:class:`ConfigError`).
    Raises :class:`NatsOrderedError` if no leader applies the request in ``timeout`` (no
    member running) or the group does not settle.
    """
    t0 = time.monotonic()
    if isinstance(cordon, str):
        raise ConfigError(f"cordon must be a list of member ids, not the string {cordon!r}")
    store = await GroupStore.attach(nc, stream, group)
    data, _ = await store.read_assignment()
    before = Assignment.from_json(data) if data else None
    try:
        wanted_weights = {int(p): float(w) for p, w in (weights or {}).items()}
    except (TypeError, ValueError):
        raise ConfigError(
            f"rebalance of group {group} refused: weights must map partition numbers to "
            f"loads, got {weights!r}"
        ) from None
    # refuse here what the leader could not obey (bad weights, cordoning every member) and
    # what it would quietly ignore (an unknown member, a partition the group does not have)
    members_now = await live_members(nc, stream, group)
    described = await describe(nc, stream)
    partitions = (await group_layout(nc, described, group)).partitions
    current_policy, _ = await store.read_policy()
    check_cordon(group, cordon, members_now, before, current_policy.cordon)
    check_weight_partitions(group, wanted_weights, max(partitions, described.partitions))
    try:
        assign(
            partitions,
            members_now,
            before,
            weights=wanted_weights or None,
            cordon=cordon,
            slack=slack if wanted_weights else None,
        )
    except ValueError as exc:
        raise ConfigError(f"rebalance of group {group} refused: {exc}") from None
    request = uuid.uuid4().hex
    while True:
        policy, rev = await store.read_policy()
        wanted = RebalancePolicy(
            cordon=sorted(set(cordon)),
            weights=wanted_weights,
            slack=slack,
            request=request,
            applied=policy.applied,
        )
        if await store.write_policy(wanted, rev) is not None:
            break
    deadline = t0 + timeout
    while True:
        policy, _ = await store.read_policy()
        if policy.applied == request:
            if policy.error:  # membership changed in between (e.g. the last one cordoned)
                raise NatsOrderedError(f"group {group}: {policy.error}")
            break
        if policy.request != request:
            raise NatsOrderedError(
                f"another rebalance request for group {group} replaced this one; check "
                f"`nats-ordered status --stream {stream} --group {group}`"
            )
        if time.monotonic() > deadline:
            raise NatsOrderedError(
                f"no leader of group {group} (stream {stream}) applied the rebalance within "
                f"{timeout:g}s: are its workers running? (`nats-ordered status --stream "
                f"{stream} --group {group}`)"
            )
        await asyncio.sleep(0.1)
    data, _ = await store.read_assignment()
    after = Assignment.from_json(data) if data else Assignment(0, {})
    members = await live_members(nc, stream, group)  # idle and cordoned ones count too
    while True:
        snap = await store.snapshot()
        unsettled = {
            p: owner for p, owner in after.owners.items() if snap.leases.get(p, ("", 0))[0] != owner
        }
        if not unsettled:
            break
        if time.monotonic() > deadline:
            shown = ", ".join(f"{p} -> {m}" for p, m in list(unsettled.items())[:8])
            raise NatsOrderedError(
                f"group {group} did not settle within {timeout:g}s after generation "
                f"{after.generation}: partitions not yet claimed by their owner: {shown}"
            )
        await asyncio.sleep(0.1)
    return Rebalanced(
        stream,
        group,
        after.generation,
        moves(before, after),
        dict(after.owners),
        imbalance(before, weights, members) if weights and before else None,
        imbalance(after, weights, members) if weights else None,
        time.monotonic() - t0,
    )


def check_cordon(
    group: str,
    cordon: Sequence[str],
    live: Sequence[str],
    assignment: Assignment | None,
    cordoned: Sequence[str],
) -> None:
    """Refuse (:class:`ConfigError`) a cordon naming a member the group does not know.

    Known: a ``live`` member (heartbeat not expired), a member owning partitions in the
    ``assignment`` in force (its heartbeat just expired: the leader has not moved its
    partitions yet), and a member ``cordoned`` by the request in force (it may have left for
    its maintenance; each request replaces the cordon, so keeping it cordoned while adding
    another means naming it again). A cordon of a known member that is not live moves
    nothing now; it keeps that member from getting partitions when it comes back, until a
    rebalance without it. Anything else would be obeyed as a no-op (nobody by that id owns
    anything), which is what a typo or another deployment's member id looked like."""
    known = set(live) | set(assignment.owners.values() if assignment else ()) | set(cordoned)
    unknown = sorted({m for m in cordon if m not in known})
    if not unknown:
        return
    alive = ", ".join(sorted(live)) or "none (no worker is running)"
    gone = sorted(known - set(live))
    also = f"; known but not live: {', '.join(gone)}" if gone else ""
    raise ConfigError(
        f"rebalance of group {group} refused: cordon names member(s) the group does not "
        f"know: {', '.join(unknown)}. The group's live members are {alive}{also} "
        "(`nats-ordered status` lists them)"
    )


def check_weight_partitions(group: str, weights: Mapping[int, float], partitions: int) -> None:
    """Refuse (:class:`ConfigError`) weights for partitions outside ``0..partitions-1``
    (the larger of the group's layout and the stream's current one, so measured rates stay
    valid while the group has not yet moved to a repartitioned layout)."""
    outside = sorted(p for p in weights if not 0 <= p < partitions)
    if outside:
        raise ConfigError(
            f"rebalance of group {group} refused: weights name partition(s) "
            f"{', '.join(map(str, outside))}, which the group does not have (its partitions "
            f"are 0..{partitions - 1})"
        )


async def partition_rates(nc: NATS, stream: str, window: float = 3600.0) -> dict[int, float]:
    """Messages per second stored in each partition over the last ``window`` seconds (what
    a rebalance by load weighs). Counted by the server: an ephemeral consumer per partition
    starting at ``now - window`` reports how many messages it has pending."""
    described = await describe(nc, stream)
    js = jetstream(nc)
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=window)

    async def rate(p: int) -> tuple[int, float]:
        info = await js.add_consumer(
            described.name,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_TIME,
                opt_start_time=since,  # nats-py sends it as RFC 3339 UTC
                ack_policy=api.AckPolicy.NONE,
                filter_subject=described.subject(p),
                mem_storage=True,
                inactive_threshold=5.0,
            ),
        )
        with contextlib.suppress(Exception):
            await js.delete_consumer(described.name, info.name or "")
        return p, (info.num_pending or 0) / window

    return dict(await asyncio.gather(*(rate(p) for p in range(described.partitions))))
