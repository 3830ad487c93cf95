"""A member across a repartition (:class:`EpochSwitch`, a part of :class:`~.worker.Worker`).

A group processes one layout epoch at a time (see :mod:`..stream.layout`): the epoch in its state
key ``epoch`` (absent: the stream's oldest layout). While that is an earlier epoch than the
stream's, its partitions are owned, leased, committed and fenced exactly as before the
repartition, under their own keys. Every :data:`EPOCH_CHECK_EVERY` seconds each member
looks at the stream; once **every** partition of the group's epoch has a commit record at
or past the last record of its subject (an empty partition counts as finished), one member
moves the group's key to the next epoch by compare-and-set. Each member then hands back
what it holds of the old epoch (all finished: nothing is left to process), and reads,
assigns and claims the new epoch's partitions from scratch.

Guarantees: no record of epoch k+1 is handed to a handler before every record of epoch k
was handled and committed (murmur3 sends the keys of any old partition to any new one, so
the barrier is over all old partitions, not partition by partition); the same holds from
one epoch to the next when the stream was repartitioned twice before the group caught up.
A member killed during the switch changes nothing: the barrier is read from commit
records, and the CAS on ``epoch`` moves the group once. The group does not move past a
layout whose switch point is still pending (a repartition running or interrupted: the
next ``repartition`` run completes it); the member says so in its problems meanwhile.

A sink's applied position of partition ``n`` that belongs to an earlier layout (at or below
the previous layout's switch point, or the sequence of a record on an earlier layout's
subject) is not this epoch's partition ``n``'s: the new partition has applied nothing yet,
so it is neither checked against the new subject nor taken for a floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import KeyWrongLastSequenceError

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.kv import compact_json, latest_entry
from airflow_nats_ordered.core.stream.layout import (
    GROUP_EPOCH_KEY,
    group_epoch_of,
    partition_of,
    pending_switch_problem,
)
from airflow_nats_ordered.core.stream.message import AppliedPosition
from airflow_nats_ordered.core.stream.partitioned import (
    PartitionedStream,
    describe,
    stream_contents,
)
from airflow_nats_ordered.core.worker.context import MemberContext

log = logging.getLogger(__name__)

#: seconds between two looks at the stream's layout epoch
EPOCH_CHECK_EVERY = 2.0


async def read_group_epoch(nc: NATS, store: GroupStore, stream: PartitionedStream) -> int:
    """The layout epoch ``store``'s group processes (its ``epoch`` key, read from the leader;
    the stream's oldest layout if it has none)."""
    found = await latest_entry(nc, store.cfg.state_bucket, GROUP_EPOCH_KEY)
    return group_epoch_of(found[0] if found else None, stream.oldest_epoch)


async def group_layout(nc: NATS, described: PartitionedStream, group: str) -> PartitionedStream:
    """``described`` as group ``group`` reads it now: the layout of its epoch (the stream's
    oldest while the group has no state or has not passed a switch)."""
    bucket = GroupConfig(described.name, group).state_bucket
    found = await latest_entry(nc, bucket, GROUP_EPOCH_KEY)
    epoch = group_epoch_of(found[0] if found else None, described.oldest_epoch)
    return described.at_epoch(epoch)


async def epoch_finished(nc: NATS, store: GroupStore, stream: PartitionedStream) -> list[int]:
    """The partitions of ``stream``'s layout (a view :meth:`~..stream.partitioned.PartitionedStream.
    at_epoch`) whose commit record is still short of their subject's last record; empty
    when the whole epoch is processed."""
    contents = await stream_contents(nc, stream)
    behind = []
    for s in contents.partitions:
        if s.last_seq <= 0:
            continue
        rec, _ = await store.read_commit(s.partition)
        if rec is None or rec.seq < s.last_seq:
            behind.append(s.partition)
    return behind


async def advance_group_epoch(nc: NATS, store: GroupStore, stream: PartitionedStream) -> int:
    """Move the group from ``store.epoch`` to the next epoch by compare-and-set; returns the
    group's epoch afterwards (another member's move counts the same)."""
    for _ in range(10):
        found = await latest_entry(nc, store.cfg.state_bucket, GROUP_EPOCH_KEY)
        value, rev = (found[0], found[1]) if found else (None, 0)
        now = group_epoch_of(value, stream.oldest_epoch)
        if now != store.epoch:
            return now
        data = compact_json({"epoch": now + 1, "from": now})
        try:
            if rev == 0:
                await store.state.create(GROUP_EPOCH_KEY, data)
            else:
                await store.state.update(GROUP_EPOCH_KEY, data, last=rev)
            return now + 1
        except KeyWrongLastSequenceError:
            continue
    raise NatsError(f"the epoch key of group {store.cfg.group} keeps changing")


class EpochSwitch:
    """A member's part that follows the group's layout epoch (see the module)."""

    def __init__(
        self,
        ctx: MemberContext,
        trouble: Callable[..., None],
        sink_applied: AppliedPosition | None,
        pause_claims: Callable[[], Awaitable[None]],
        resume_claims: Callable[[], None],
    ) -> None:
        #: read here: the connection, settings, store, member id, owned partitions and
        #: whether it is stopping; written: the store's epoch and the stream (:meth:`enter`),
        #: owned partitions (handed back at a switch) and problems
        self.ctx = ctx
        self._trouble = trouble
        #: the sink's applied position of a partition, as the handler's hook gives it
        self._sink_applied = sink_applied
        #: stop the leader's and the reconcile loop: nothing is claimed during a switch
        self._pause_claims = pause_claims
        #: start claiming over in the epoch entered (forget the old one's assignment)
        self._resume_claims = resume_claims
        #: sequences at or below this belong to earlier layouts than the member's epoch
        self._epoch_start = 0

    def enter(self, described: PartitionedStream, epoch: int) -> None:
        """Process layout epoch ``epoch`` of the stream ``described``."""
        self.ctx.store.epoch = epoch
        self.ctx.stream = described.at_epoch(epoch)
        self._epoch_start = max(
            (lay.switch_seq for lay in described.layouts if lay.epoch < epoch), default=0
        )

    async def applied(self, p: int) -> Any:
        """The sink's applied position of ``p`` if it belongs to the member's epoch: a
        position at or below the previous layout's switch point was applied under an
        earlier layout (another partition with the same number), so this epoch's
        partition has applied nothing yet."""
        assert self._sink_applied is not None
        store, stream = self.ctx.store, self.ctx.stream
        r = self._sink_applied(p)
        pos = await r if inspect.isawaitable(r) else r
        if pos is None or store.epoch == stream.oldest_epoch:
            return pos
        if self._epoch_start and int(pos[0]) <= self._epoch_start:
            return None
        # a switch point recorded too low (by an earlier version) or not at all: the
        # record at the position says which layout it belongs to
        found = await store.stored_at(int(pos[0]))
        earlier = [lay for lay in stream.layouts if lay.epoch < store.epoch]
        if found.subject is not None and any(
            partition_of(stream.prefix, lay.epoch, lay.partitions, found.subject) is not None
            for lay in earlier
        ):
            return None
        return pos

    async def run(self) -> None:
        """The epoch loop (a background loop of the member)."""
        ctx = self.ctx
        while True:
            await asyncio.sleep(EPOCH_CHECK_EVERY)
            if ctx.stopping:
                return
            store = ctx.store
            try:
                described = await describe(ctx.nc, ctx.cfg.stream)
                if described.current_epoch == store.epoch:
                    continue
                target = await read_group_epoch(ctx.nc, store, described)
                if target == store.epoch:
                    pending = described.pending_switch
                    if pending is not None and pending.epoch >= store.epoch:
                        ctx.report(
                            "epoch",
                            pending_switch_problem(
                                described.name,
                                described.current_partitions,
                                described.current_epoch,
                                pending.epoch,
                            ),
                        )
                        continue
                    behind = await epoch_finished(ctx.nc, store, ctx.stream)
                    if behind:
                        ctx.report(
                            "epoch",
                            f"finishing layout epoch {store.epoch} before the stream's "
                            f"epoch {described.current_epoch}: partitions {behind} not yet "
                            "processed to their last record",
                        )
                        continue
                    target = await advance_group_epoch(ctx.nc, store, described)
                if target != store.epoch:
                    await self._switch(described, target)
            except (TimeoutError, NatsError, NatsOrderedError) as exc:
                self._trouble("checking the layout epoch failed", exc)

    async def _switch(self, described: PartitionedStream, target: int) -> None:
        """Hand back everything of the old epoch, then start over on ``target``."""
        ctx, owned = self.ctx, self.ctx.owned
        old = ctx.store.epoch
        log.info(
            "member %s: group %s moves from layout epoch %d to %d (%d partitions)",
            ctx.member,
            ctx.cfg.group,
            old,
            target,
            described.at_epoch(target).partitions,
        )
        await self._pause_claims()
        for o in list(owned.values()):
            o.revoke.set()
        tasks = [o.task for o in owned.values() if o.task]
        if tasks:
            await asyncio.wait(tasks, timeout=ctx.cfg.stop_timeout)
        for o in list(owned.values()):  # still in on_assign, or stuck: give it back
            if o.task is not None and not o.task.done():
                o.task.cancel()
            async with o.lock:
                o.releasing = True
                with contextlib.suppress(Exception):
                    await ctx.store.release(o.lease)
            if owned.get(o.partition) is o:
                del owned[o.partition]
        self.enter(described, target)
        ctx.report("epoch", None)
        self._resume_claims()
