"""A member's heartbeat (:class:`Heartbeat`, a part of :class:`~.worker.Worker`): every renew
interval it renews the member's key, the lease of every partition it holds and the leader
lease, and it stops a partition whose lease is lost.

Guarantees (its share of the member's exclusive ownership, see :mod:`.worker`)
------------------------------------------------------------------------------
* **Renewals keep up.** All renewals of a round go out together (one after another,
  behind a busy event loop, they could outlast the lease's safety margin), each under its
  partition's lock and never once the partition's final commit and release began; each
  group-state call is bounded (:meth:`~.context.MemberContext.call_bound`: a bucket
  electing a leader answers nothing) and one with no answer is retried next round.
* **A lost lease stops its partition, once**, whatever stage it is in: still in
  ``on_assign`` (the claim is forgotten, to be claimed afresh), processing (its task is
  cancelled, and it finds the lease invalid before its next message anyway), or already
  handing over (left to finish its clean-up).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from nats.errors import Error as NatsError

from airflow_nats_ordered.core.group.leases import Lease, LeaseLost
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.leader import Leader
from airflow_nats_ordered.core.worker.owned import OwnedPartition

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")


class Heartbeat:
    """The member's heartbeat loop (see the module)."""

    def __init__(self, ctx: MemberContext, leader: Leader, trouble: Callable[..., None]) -> None:
        #: read here: the connection, settings, store, member id, owned partitions and
        #: problems; written: owned partitions (a lost one), statistics, the audit trail
        self.ctx = ctx
        #: whose lease is renewed in the same round
        self.leader = leader
        self._trouble = trouble
        #: the member's own key in the lease bucket (its membership)
        self.member_lease: Lease | None = None
        #: the loop ends (set by ``stop()`` once hand-over is done)
        self.closing = False
        self._started = time.time()
        #: seconds the last round of renewals took (member heartbeat + every lease)
        self.renew_seconds = 0.0
        #: monotonic time of the last member heartbeat the server accepted (0: none yet)
        self.last_heartbeat = 0.0

    def info(self) -> dict[str, Any]:
        """What the member's key says about it (``status`` shows it)."""
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self._started,
            "partitions": sorted(self.ctx.owned),
            "problems": sorted(self.ctx.problems.values()),
        }

    async def join(self) -> None:
        """Store the member's key: the member joins the group."""
        ctx = self.ctx
        self.member_lease = await ctx.store.heartbeat(ctx.member, None, self.info())

    async def run(self) -> None:
        """The heartbeat loop (a background loop of the member)."""
        ctx = self.ctx
        while not self.closing:
            await asyncio.sleep(ctx.cfg.group_config.renew_interval)
            if ctx.nc.is_closed:
                # the client gave up reconnecting: nothing can be renewed or committed again
                raise ConnectionError("the NATS connection is closed")
            started = time.monotonic()
            try:
                # bounded by one renewal interval: during a leader election of the lease
                # bucket nothing answers, and nats-py's 5 s per call would hold every
                # renewal (and the member's return) back for seconds after it ended
                async with asyncio.timeout(ctx.call_bound()):
                    self.member_lease = await ctx.store.heartbeat(
                        ctx.member, self.member_lease, self.info()
                    )
                self.last_heartbeat = time.monotonic()
            except (TimeoutError, NatsError) as exc:
                self._trouble("heartbeat failed", exc)
            # all renewals in one round trip (each under its partition's lock): sequential
            # renewals behind a busy event loop could outlast the lease margin
            await asyncio.gather(*(self._renew(o) for o in list(ctx.owned.values())))
            self.renew_seconds = time.monotonic() - started
            await self.leader.renew()

    async def _renew(self, o: OwnedPartition) -> None:
        async with o.lock:
            if o.releasing:
                return  # handing over: its final commit and release own the lease
            try:
                # a renewal with no answer is retried next round (a lost reply of an
                # applied one is adopted then, see GroupLeases.renew)
                async with asyncio.timeout(self.ctx.call_bound()):
                    await self.ctx.store.renew(o.lease)
                self.ctx.audit_lease(o.partition, o.lease, o.grant.token)
            except LeaseLost as exc:
                self._lease_lost(o, exc)
            except (NatsError, TimeoutError) as exc:
                self._trouble("renewing partition %d failed", exc, o.partition)

    def _lease_lost(self, o: OwnedPartition, exc: LeaseLost) -> None:
        """Stop a partition whose lease is gone, exactly once, whatever stage it is in."""
        owned = self.ctx.owned
        if owned.get(o.partition) is not o:
            return  # already on its way out
        self.ctx.stats["leases_lost"] += 1
        log.warning("member %s: %s; stopping partition %d", self.ctx.member, exc, o.partition)
        # the processing loop checks validity before every message: it stops there even if
        # the cancel below were swallowed
        o.lease.valid_until = 0.0
        o.lost = True
        if o.task is None:
            # still in on_assign (e.g. the process was paused there): forget the claim so the
            # partition can be claimed afresh; the claim sees this when on_assign returns
            del owned[o.partition]
        elif not o.task.done() and not o.task.cancelling() and not o.finishing:
            # once: a second cancel would interrupt the task's own clean-up
            o.task.cancel()
