"""The group's leader (:class:`Leader`, a part of :class:`~.worker.Worker`): the one member
holding the ``leader`` lease computes the assignment of partitions to live members.

Guarantees: only the holder of a valid leader lease writes the assignment, by
compare-and-set on its revision, so two members that both think they lead cannot interleave
writes; the assignment is sticky (:mod:`..group.assignor`) and a new generation is written only when
owners change; live members are listed by the server (:func:`..stream.kv.bucket_keys`), never by a
watcher that can come back empty; a rebalance policy that cannot be obeyed is reported as
a problem and the group falls back to the plain sticky assignment, never a stopped leader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from airflow_nats_ordered.core.group.assignment import RebalancePolicy
from airflow_nats_ordered.core.group.assignor import Assignment, assign
from airflow_nats_ordered.core.group.leases import Lease, LeaseLost
from airflow_nats_ordered.core.stream.kv import bucket_keys
from airflow_nats_ordered.core.worker.context import MemberContext

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")


class Leader:
    """A member's part as the group's leader (see the module): it tries for the ``leader``
    lease every tick and, while it holds it, writes the assignment."""

    def __init__(self, ctx: MemberContext, trouble: Callable[..., None]) -> None:
        #: read here: the connection, settings, store, stream, member id, whether it is
        #: stopping; written: problems (``policy``) and the audit trail
        self.ctx = ctx
        self._trouble = trouble
        #: the leader lease while this member holds it (renewed by the heartbeat)
        self.lease: Lease | None = None

    async def renew(self) -> None:
        """Renew the leader lease if held (a round of the heartbeat); a lease that cannot be
        renewed is dropped, and the loop tries for it again."""
        if self.lease is not None:
            try:
                await self.ctx.store.renew(self.lease)
            except (TimeoutError, LeaseLost, NatsError):
                self.lease = None

    async def live_members(self) -> list[str]:
        """The members whose membership key is stored (listed by the server)."""
        ctx = self.ctx
        members = []
        for key in await bucket_keys(ctx.nc, ctx.cfg.group_config.lease_bucket, "m."):
            try:
                await ctx.store.leases.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            members.append(key[2:])
        return members

    async def run(self) -> None:
        """The leader's loop (a background loop of the member)."""
        ctx = self.ctx
        while True:
            await asyncio.sleep(ctx.cfg.tick)
            if ctx.stopping:
                return
            try:
                lease = self.lease  # the heartbeat loop may drop it meanwhile
                if lease is None or not lease.valid:
                    # bounded like every call of the member's loops (MemberContext.call_bound):
                    # a bucket electing a leader does not answer at all
                    async with asyncio.timeout(ctx.call_bound()):
                        lease = await ctx.store.acquire("leader", ctx.member)
                    self.lease = lease
                    if lease is None:
                        continue
                    log.info("member %s is the leader of group %s", ctx.member, ctx.cfg.group)
                async with asyncio.timeout(ctx.call_bound()):
                    members = await self.live_members()
                if not lease.valid:
                    continue
                if ctx.member not in members:
                    # the leader's own membership key is not (yet again) stored: after the
                    # lease bucket lost its leader every key aged out meanwhile, and an
                    # assignment now would hand every partition to nobody and revoke them
                    # all. The members' next heartbeats store their keys within a renewal
                    # interval; decide then
                    continue
                data, rev = await ctx.store.read_assignment()
                previous = Assignment.from_json(data) if data else None
                policy, policy_rev = await ctx.store.read_policy()
                new, refused = self._assign(members, previous, policy)
                changed = previous is None or new.owners != previous.owners
                written = await ctx.store.write_assignment(new.to_json(), rev) if changed else rev
                if written is not None and policy.pending:
                    policy.applied, policy.error = policy.request, refused or ""
                    await ctx.store.write_policy(policy, policy_rev)
                if changed and written is not None:
                    ctx.audit(
                        kind="assignment",
                        generation=new.generation,
                        members=members,
                        owners={str(k): v for k, v in new.owners.items()},
                    )
                    log.info(
                        "generation %d: %s",
                        new.generation,
                        {m: new.partitions_of(m) for m in members},
                    )
            except (TimeoutError, NatsError) as exc:
                self._trouble("leader loop", exc)

    def _assign(
        self, members: list[str], previous: Assignment | None, policy: RebalancePolicy
    ) -> tuple[Assignment, str | None]:
        """The leader's assignment under the group's rebalance policy, and why the policy
        was not obeyed if it was not. Its slack applies only to a pending request (an
        explicit rebalance). A policy that cannot be obeyed (cordoning every live member,
        weights that are not loads) is reported, never allowed to stop the leader: the
        group falls back to the plain sticky assignment."""
        weights = policy.weights or None
        partitions = self.ctx.stream.partitions
        try:
            new = assign(
                partitions,
                members,
                previous,
                weights=weights,
                cordon=policy.cordon,
                slack=policy.slack if weights and policy.pending else None,
            )
        except ValueError as exc:
            refused = f"rebalance policy not applied: {exc}"
            self.ctx.report("policy", refused)
            return assign(partitions, members, previous), refused
        self.ctx.report("policy", None)
        return new, None
