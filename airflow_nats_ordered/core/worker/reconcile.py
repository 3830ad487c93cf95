"""Following the assignment (:class:`Reconciler`, a part of :class:`~.worker.Worker`): every
tick the member reads the assignment the leader wrote, revokes the partitions that moved
away and claims those that moved to it.

A claim takes the partition's lease (:func:`~.lease_claims.claim_lease`), is granted a
fencing token (above the highest the sink has seen, if the handler's ``fencing_floor``
says), calls ``on_assign`` and then starts the partition's delivery
(:meth:`~.delivery.Delivery.run_partition`).

Guarantees (its share of cooperative rebalancing, see :mod:`.worker`)
---------------------------------------------------------------------
* **Only what moves pauses.** Only partitions the assignment moved away are revoked (their
  delivery commits and releases them at once); the others go on undisturbed.
* **Hooks in order.** ``on_assign(p)`` never runs before this member's previous
  ``on_revoke(p)`` has returned: a partition is claimed again only once its last task ended.
* **A lapsed claim is given up.** A lease that lapsed between claim and grant, or while
  ``on_assign`` ran, is given back before anything is processed (a newer owner may exist)
  and the partition is claimed afresh; a claim cancelled by ``stop()`` gives back what it
  got (:mod:`.lease_claims`).
* **Failures back off.** A blip (server restart, leader change) is retried next tick;
  anything else (:mod:`.backoff`) later and later, reported in the member's problems.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import Error as NatsError

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.assignor import Assignment
from airflow_nats_ordered.core.stream.layout import state_key
from airflow_nats_ordered.core.worker.backoff import ClaimBackoff
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.delivery import Delivery
from airflow_nats_ordered.core.worker.lease_claims import claim_lease
from airflow_nats_ordered.core.worker.owned import OwnedPartition

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

#: how many times a member that has read no assignment yet looks for one at a tenth of the
#: tick (the first assignment, written by the leader's first round, is found without
#: waiting a whole tick more)
QUICK_ROUNDS = 20


class Reconciler:
    """The member's reconcile loop and its claims (see the module)."""

    def __init__(
        self,
        ctx: MemberContext,
        delivery: Delivery,
        backoff: ClaimBackoff,
        trouble: Callable[..., None],
        on_assign: Callable[[int, int], Any] | None,
        fencing_floor: Callable[[int], int | Awaitable[int]] | None,
    ) -> None:
        #: read here: the settings, store, member id, whether it is stopping; written:
        #: owned partitions (claimed, revoked), statistics, problems, the audit trail
        self.ctx = ctx
        #: starts each claimed partition's task
        self.delivery = delivery
        self.backoff = backoff
        self._trouble = trouble
        self.on_assign = on_assign
        self.fencing_floor = fencing_floor
        #: the assignment's generation the member last read
        self.generation = 0
        #: the partitions the latest assignment read gives this member
        self.mine: set[int] = set()
        self._assignment_rev = 0
        #: the last processing task of each partition: it is claimed again only once that
        #: task (and its on_revoke) has finished
        self.previous: dict[int, asyncio.Task[None]] = {}
        #: set once the member claimed every partition of its first assignment
        self.assigned = asyncio.Event()

    def forget(self) -> None:
        """Forget the assignment read, the claims' back-offs and the partitions' last tasks
        (an epoch switch: the next epoch is read, assigned and claimed from scratch)."""
        self.previous.clear()
        self.backoff.clear()
        self.mine = set()
        self._assignment_rev = 0

    def claimed(self) -> set[int]:
        """The partitions this member is processing (claimed, ``on_assign`` returned)."""
        return {p for p, o in self.ctx.owned.items() if o.task is not None}

    async def run(self) -> None:
        """The reconcile loop (a background loop of the member)."""
        ctx, owned = self.ctx, self.ctx.owned
        quick = QUICK_ROUNDS
        while True:
            # a member that has read no assignment yet looks again every tick / 10 (at most
            # QUICK_ROUNDS times): the leader writes the first one a tick after it joined,
            # and a whole tick more before the first claim was a tenth of a 100k-record run
            if self._assignment_rev or quick <= 0:
                await asyncio.sleep(ctx.cfg.tick)
            else:
                quick -= 1
                await asyncio.sleep(ctx.cfg.tick / 10)
            if ctx.stopping:
                return
            try:
                async with asyncio.timeout(ctx.call_bound()):
                    data, rev = await ctx.store.read_assignment()
            except (TimeoutError, NatsError) as exc:
                self._trouble("reading the assignment failed", exc)
                continue
            if data is not None and rev != self._assignment_rev:
                a = Assignment.from_json(data)
                self._assignment_rev = rev
                self.generation = a.generation
                mine = set(a.partitions_of(ctx.member))
                if mine != self.mine:
                    ctx.stats["rebalances"] += 1
                self.mine = mine
            # release what moved away (cooperative: only these pause)
            for p in [p for p in owned if p not in self.mine]:
                owned[p].revoke.set()
            # claim what moved here; a previous owner may still be handing it over
            todo = []
            for p in sorted(self.mine - set(owned)):
                previous = self.previous.get(p)
                if previous is not None and not previous.done():
                    continue  # on_assign(p) never runs before this member's on_revoke(p) ended
                if self.backoff.waiting(p):
                    continue
                todo.append(p)
            if self.on_assign is None and self.fencing_floor is None:
                # no handler hooks to call one partition at a time: claim them all at once
                # (one after another, the claims of a member starting up waited behind
                # the slices of handler work of the partitions already claimed: the last
                # of 16 began half-way through a 100k-record backlog)
                await asyncio.gather(*(self.claim(p) for p in todo))
            else:
                for p in todo:
                    if ctx.stopping:
                        return
                    await self.claim(p)
            if self.mine and self.mine <= self.claimed():
                self.assigned.set()

    async def claim(self, p: int) -> None:
        """Claim ``p`` (:meth:`try_claim`); a failure is reported, and retried next tick
        or after a back-off."""
        if self.ctx.stopping:
            return
        try:
            await self.try_claim(p)
        except (NatsError, TimeoutError) as exc:
            # a blip (server restart, leader change): next tick
            self._trouble("claiming partition %d failed", exc, p)
        except NatsOrderedError as exc:
            # not a blip (a contended token, a missing commit record, a re-created
            # stream): retry later and later, and say so in the status
            self._trouble("claiming partition %d failed", exc, p)
            self.backoff.failed(p, f"claiming failed: {exc}")

    async def _floor(self, p: int) -> int:
        """The highest fencing token the handler's sink has seen for ``p`` (0 if unknown)."""
        if self.fencing_floor is None:
            return 0
        try:
            r = self.fencing_floor(p)
            return int(await r if inspect.isawaitable(r) else r)
        except Exception as exc:  # e.g. the sink is unavailable: back off like on_assign
            raise NatsOrderedError(
                f"fencing_floor({p}) failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def try_claim(self, p: int) -> None:
        """Take ``p``'s lease, be granted its token, call ``on_assign`` and start the
        partition's task (or give the lease back, see the module)."""
        ctx, store, member = self.ctx, self.ctx.store, self.ctx.member
        # each group-state step bounded (the handler's hooks are not): a bucket electing a
        # leader answers nothing; a claim cancelled by stop() gives back what it got
        key, bound = state_key(store.epoch, "p", p), ctx.call_bound()
        lease = await claim_lease(store, key, member, bound)
        if lease is None:
            return
        try:
            floor = await self._floor(p)
            async with asyncio.timeout(ctx.call_bound()):
                grant = await store.grant(p, member, floor=floor)
        except BaseException:  # including cancellation by stop(): give the lease back
            await asyncio.shield(store.release(lease))
            raise
        if not lease.valid:
            # paused between claim and grant: a newer owner may exist, do not fence it off
            # further with on_assign; the partition is claimed afresh next tick
            with contextlib.suppress(NatsError, TimeoutError):
                await store.release(lease)
            return
        # registered first, so the heartbeat renews the lease while on_assign runs (a sink
        # may wait on a lock); processing starts only once on_assign has returned
        owned = OwnedPartition(p, lease, grant)
        ctx.owned[p] = owned
        ctx.audit_lease(p, lease, grant.token)
        if self.on_assign is not None:
            try:
                r = self.on_assign(p, grant.token)
                if inspect.isawaitable(r):
                    await r
            except Exception as exc:
                # e.g. the sink is unavailable: give the partition back, retry with backoff
                log.exception(
                    "member %s: on_assign(%d, %d) failed; releasing the partition",
                    member,
                    p,
                    grant.token,
                )
                if ctx.owned.get(p) is owned:
                    del ctx.owned[p]
                self.backoff.failed(p, f"on_assign failed: {type(exc).__name__}: {exc}")
                await store.release(lease)
                return
            if ctx.owned.get(p) is not owned or not lease.valid:
                # the lease lapsed while on_assign ran: someone else may own the partition now
                log.warning(
                    "member %s: lease of partition %d lapsed during on_assign; giving it up",
                    member,
                    p,
                )
                if ctx.owned.get(p) is owned:
                    del ctx.owned[p]
                with contextlib.suppress(NatsError, TimeoutError):
                    await store.release(lease)
                return
        owned.task = self.previous[p] = asyncio.ensure_future(self.delivery.run_partition(owned))
        self.backoff.claimed(p)
        log.info(
            "member %s owns partition %d (token %d, from seq %d)",
            member,
            p,
            grant.token,
            grant.committed + 1,
        )
