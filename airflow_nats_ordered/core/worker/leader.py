"""The group's leader (:class:`GroupLeader`, mixed into :class:`~.worker.Worker`): the one
member holding the ``leader`` lease computes the assignment of partitions to live members.

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

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from airflow_nats_ordered.core.group.assignor import Assignment, assign
from airflow_nats_ordered.core.group.store import GroupStore, Lease, RebalancePolicy
from airflow_nats_ordered.core.stream.kv import bucket_keys
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.worker.config import WorkerConfig

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")


class GroupLeader:
    """The leader's verbs of :class:`~.worker.Worker` (a mixin: it shares the member's
    connection, store, configuration, audit trail and problems)."""

    nc: NATS
    cfg: WorkerConfig
    store: GroupStore
    stream: PartitionedStream
    member: str
    _stopping: bool
    _leader_lease: Lease | None
    _audit: Callable[..., None]
    _report: Callable[[str, str | None], None]
    _trouble: Callable[..., None]
    _call_bound: Callable[[], float]

    async def _live_members(self) -> list[str]:
        members = []
        for key in await bucket_keys(self.nc, self.cfg.group_config.lease_bucket, "m."):
            try:
                await self.store.leases.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            members.append(key[2:])
        return members

    async def _leader_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick)
            if self._stopping:
                return
            try:
                lease = self._leader_lease  # the heartbeat loop may drop it meanwhile
                if lease is None or not lease.valid:
                    # bounded like every call of the member's loops (Worker._call_bound): a
                    # bucket electing a leader does not answer at all
                    async with asyncio.timeout(self._call_bound()):
                        lease = await self.store.acquire("leader", self.member)
                    self._leader_lease = lease
                    if lease is None:
                        continue
                    log.info("member %s is the leader of group %s", self.member, self.cfg.group)
                async with asyncio.timeout(self._call_bound()):
                    members = await self._live_members()
                if not lease.valid:
                    continue
                if self.member not in members:
                    # the leader's own membership key is not (yet again) stored: after the
                    # lease bucket lost its leader every key aged out meanwhile, and an
                    # assignment now would hand every partition to nobody and revoke them
                    # all. The members' next heartbeats store their keys within a renewal
                    # interval; decide then
                    continue
                data, rev = await self.store.read_assignment()
                previous = Assignment.from_json(data) if data else None
                policy, policy_rev = await self.store.read_policy()
                new, refused = self._assign(members, previous, policy)
                changed = previous is None or new.owners != previous.owners
                written = await self.store.write_assignment(new.to_json(), rev) if changed else rev
                if written is not None and policy.pending:
                    policy.applied, policy.error = policy.request, refused or ""
                    await self.store.write_policy(policy, policy_rev)
                if changed and written is not None:
                    self._audit(
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
        try:
            new = assign(
                self.stream.partitions,
                members,
                previous,
                weights=weights,
                cordon=policy.cordon,
                slack=policy.slack if weights and policy.pending else None,
            )
        except ValueError as exc:
            refused = f"rebalance policy not applied: {exc}"
            self._report("policy", refused)
            return assign(self.stream.partitions, members, previous), refused
        self._report("policy", None)
        return new, None
