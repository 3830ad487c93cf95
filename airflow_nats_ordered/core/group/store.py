"""The consumer group's store (:class:`GroupStore`): its two KV buckets and how they are opened.

Every verb on the group's state is a method of :class:`GroupStore`; each concept lives in
the module named after it, and the store has one of each part (given the bucket, config and
stream it needs), its methods handing the verbs to them:

* :mod:`.config` - :class:`GroupConfig` (names, lease TTL, replicas, missing_commit)
* :mod:`.leases` - claim, renew, release, heartbeat (:class:`Lease`, :class:`LeaseLost`)
* :mod:`.commits` - commit records, fencing tokens, grant/commit/reset, blocked markers
  (:class:`Grant`, :class:`CommitRecord`, :class:`Fenced`, :func:`next_token`)
* :mod:`.stream_identity` - the stream's recorded identity (:class:`StreamRecreated`)
* :mod:`.assignment` - the assignment record and :class:`RebalancePolicy`
* :mod:`.status` - the ``status`` snapshot (:class:`GroupState`)
* :mod:`..stream.kv` - leader reads and bucket replicas

Each name is imported from the module that defines it.

Both buckets take the stream's replica count unless ``GroupConfig.replicas`` says otherwise,
so the group's state is as durable as the stream it reads.

``<lease bucket>`` (TTL = the group's lease TTL, so expiry is decided by the server):
    ``p.<n>``       the lease of partition n: ``{"member", "claim", "n"}`` (a nonce per claim
                    and a renewal counter: every write of a lease is unique)
    ``m.<member>``  a member's heartbeat: ``{"member", "host", "pid", "started", "ts"}``
    ``leader``      the leader lease: the member that computes the assignment
``<state bucket>`` (no TTL):
    ``stream``      the identity (creation time) of the stream the positions refer to
    ``c.<n>``       partition n's committed position and fencing token:
                    ``{"seq", "token", "member", "ts", "stream", "id"}`` (``id``: the
                    ``Nats-Msg-Id`` of the message at ``seq``, if it had one; records
                    written by earlier versions have none)
    ``assignment``  the current assignment (generation, partition -> member)
    ``blocked.<n>`` why partition n is blocked (poison policy ``block``)

Leases are claimed with ``create``, renewed with ``update(last=revision)`` and released
with ``delete(last=revision)``; a lease is treated as lost at (time the claim or renewal
was *sent* + TTL − margin) on the monotonic clock, so a member never believes in a lease
the server may already have expired. Ownership is never decided from a plain ``get``.

Fencing: after claiming a partition's lease, the new owner bumps the token stored in
``c.<n>`` by compare-and-set, so every grant's token is larger than every earlier grant's,
and any later commit by a previous owner (which still holds the old revision) fails. A new
token is ``max(previous + 1, floor + 1, now in ms)`` (:func:`~.commits.next_token`): it stays larger
than every earlier one even when ``c.<n>`` is deleted or the bucket re-created (the sink's
``floor``, or else the wall clock, is above every token issued before).

A compare-and-set that fails is not taken as proof of a newer owner: the record is read
again (from the stream leader) and, if it still carries this owner's token (commits) or
claim nonce (leases), the lost reply of an applied write is adopted.
"""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError, StreamNotFoundError
from airflow_nats_ordered.core.group.assignment import GroupAssignment, RebalancePolicy
from airflow_nats_ordered.core.group.cas_writes import Answer
from airflow_nats_ordered.core.group.commits import (
    CommitRecord,
    Grant,
    GroupCommits,
)
from airflow_nats_ordered.core.group.config import (
    GroupConfig,
)
from airflow_nats_ordered.core.group.leases import GroupLeases, Lease
from airflow_nats_ordered.core.group.status import GroupSnapshot, GroupState
from airflow_nats_ordered.core.group.stream_identity import (
    GroupStreamIdentity,
)
from airflow_nats_ordered.core.stream.continuity import AtSeq
from airflow_nats_ordered.core.stream.kv import ensure_replicas, latest_entry
from airflow_nats_ordered.core.stream.layout import GROUP_EPOCH_KEY, group_epoch_of
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, describe

__all__ = [
    "GroupStore",
]


class GroupStore:
    """The two buckets of one group and the operations on them.

    ``stream`` is the partitioned stream as described when the store was opened (``None``
    only for :meth:`attach` when the stream no longer exists). ``epoch`` is the layout
    epoch the group works on (see :mod:`..stream.layout`): every part reads it from here,
    so moving the group to another layout is setting it.

    The parts: ``leasing`` (:class:`~.leases.GroupLeases`), ``identity``
    (:class:`~.stream_identity.GroupStreamIdentity`), ``commits``
    (:class:`~.commits.GroupCommits`), ``snapshots`` (:class:`~.status.GroupSnapshot`) and
    ``assignments`` (:class:`~.assignment.GroupAssignment`), each given the connection,
    config, buckets and stream it needs when the store is made (none of them changes
    after)."""

    def __init__(
        self,
        nc: NATS,
        cfg: GroupConfig,
        leases: KeyValue,
        state: KeyValue,
        stream: PartitionedStream | None = None,
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.leases = leases
        self.state = state
        self.stream = stream
        #: the layout epoch the group's keys and partitions refer to (see .layout)
        self.epoch = 0
        self.leasing = GroupLeases(nc, cfg, leases, self._epoch)
        self.identity = GroupStreamIdentity(nc, cfg, state, stream, self._epoch)
        self.commits = GroupCommits(
            nc, cfg, state, stream, self.identity, self.leasing, self._epoch
        )
        self.snapshots = GroupSnapshot(nc, cfg, leases, state, self.identity, self._epoch)
        self.assignments = GroupAssignment(state, self._epoch)

    def _epoch(self) -> int:
        return self.epoch

    @classmethod
    async def attach(cls, nc: NATS, stream: str, group: str) -> GroupStore:
        """Open an existing group's buckets with the lease TTL it uses (for ``status``).

        Never refuses for the state of the stream (deleted, re-created): :meth:`snapshot`
        reports that in ``problems``."""
        js = jetstream(nc)
        try:
            leases = await js.key_value(GroupConfig(stream, group).lease_bucket)
            state = await js.key_value(GroupConfig(stream, group).state_bucket)
        except (BucketNotFoundError, NotFoundError) as exc:
            raise NatsOrderedError(
                f"group {group} of stream {stream} has no state yet: start a worker with "
                f"`nats-ordered worker --stream {stream} --group {group} ...`"
            ) from exc
        ttl = (await leases.status()).ttl or 5.0
        try:
            live: PartitionedStream | None = await describe(nc, stream)
        except StreamNotFoundError:
            live = None
        store = cls(nc, GroupConfig(stream, group, lease_ttl=ttl), leases, state, live)
        if live is not None:  # the layout epoch the group processes (see .layout)
            found = await latest_entry(nc, store.cfg.state_bucket, GROUP_EPOCH_KEY)
            store.epoch = group_epoch_of(found[0] if found else None, live.oldest_epoch)
        return store

    @classmethod
    async def open(cls, nc: NATS, cfg: GroupConfig, create: bool = True) -> GroupStore:
        """Open (or create) the group's buckets for the stream as it is now.

        Refuses a lease TTL that differs from the group's (ConfigError), and a stream that
        was re-created since the group recorded its identity (StreamRecreated). Buckets get
        ``cfg.replicas`` or else the stream's replica count. Existing buckets are changed in
        place to an explicit ``cfg.replicas``, and by default only ever raised to the
        stream's count (a group made R1 by an earlier version becomes R3; never lowered)."""
        stream = await describe(nc, cfg.stream)
        replicas = cfg.replicas or stream.replicas
        explicit = cfg.replicas is not None
        js = jetstream(nc)
        try:
            leases = await js.key_value(cfg.lease_bucket)
            status = await leases.status()
            ttl = status.ttl or 0
            if abs(ttl - cfg.lease_ttl) > 1e-3:
                raise ConfigError(
                    f"group {cfg.group} of stream {cfg.stream} uses a lease TTL of {ttl:g}s but "
                    f"{cfg.lease_ttl:g}s was requested; every member of a group must use the "
                    f"same TTL: pass lease_ttl={ttl:g} (CLI: --lease-ttl {ttl:g})"
                )
            await ensure_replicas(nc, cfg.lease_bucket, replicas, explicit=explicit)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise NatsOrderedError(
                    f"group {cfg.group} of stream {cfg.stream} does not exist (no worker has "
                    "joined it yet)"
                ) from None
            leases = await js.create_key_value(
                api.KeyValueConfig(
                    bucket=cfg.lease_bucket,
                    ttl=cfg.lease_ttl,
                    history=1,
                    replicas=replicas,
                    storage=api.StorageType.FILE,
                    description=f"nats-ordered leases of group {cfg.group} on {cfg.stream}",
                )
            )
        try:
            state = await js.key_value(cfg.state_bucket)
            await ensure_replicas(nc, cfg.state_bucket, replicas, explicit=explicit)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise
            state = await js.create_key_value(
                api.KeyValueConfig(
                    bucket=cfg.state_bucket,
                    history=1,
                    replicas=replicas,
                    storage=api.StorageType.FILE,
                    description=f"nats-ordered commits of group {cfg.group} on {cfg.stream}",
                )
            )
        store = cls(nc, cfg, leases, state, stream)
        await store.identity.record_stream(stream)
        return store

    # leases (.leases)

    async def acquire(self, key: str, member: str) -> Lease | None:
        """See :meth:`.GroupLeases.acquire`."""
        return await self.leasing.acquire(key, member)

    async def renew(self, lease: Lease) -> Lease:
        """See :meth:`.GroupLeases.renew`."""
        return await self.leasing.renew(lease)

    async def release(self, lease: Lease) -> None:
        """See :meth:`.GroupLeases.release`."""
        await self.leasing.release(lease)

    async def heartbeat(self, member: str, lease: Lease | None, info: dict[str, Any]) -> Lease:
        """See :meth:`.GroupLeases.heartbeat`."""
        return await self.leasing.heartbeat(member, lease, info)

    # the stream's identity (.stream_identity)

    async def check_stream(self) -> PartitionedStream:
        """See :meth:`.GroupStreamIdentity.check_stream`."""
        return await self.identity.check_stream()

    def recreated_message(self, recorded: str, now: str) -> str:
        """See :meth:`.GroupStreamIdentity.recreated_message`."""
        return self.identity.recreated_message(recorded, now)

    # commits and fencing tokens (.commits)

    async def read_commit(self, partition: int) -> tuple[CommitRecord | None, int]:
        """See :meth:`.GroupCommits.read_commit`."""
        return await self.commits.read_commit(partition)

    async def grant(self, partition: int, member: str, *, floor: int = 0) -> Grant:
        """See :meth:`.GroupCommits.grant`."""
        return await self.commits.grant(partition, member, floor=floor)

    async def reset(self, partition: int, seq: int, *, by: str = "reset") -> tuple[int, int]:
        """See :meth:`.GroupCommits.reset`."""
        return await self.commits.reset(partition, seq, by=by)

    async def stored_at(self, seq: int) -> AtSeq:
        """See :meth:`.GroupCommits.stored_at`."""
        return await self.commits.stored_at(seq)

    async def commit(self, grant: Grant, seq: int, msg_id: str | None = None) -> None:
        """See :meth:`.GroupCommits.commit`."""
        await self.commits.commit(grant, seq, msg_id)

    async def send_commit(
        self, grant: Grant, seq: int, msg_id: str | None, answer: Answer, timeout: float
    ) -> None:
        """See :meth:`.GroupCommits.send_commit`."""
        await self.commits.send_commit(grant, seq, msg_id, answer, timeout)

    @staticmethod
    def commit_accepted(grant: Grant, seq: int, msg_id: str | None, revision: int) -> None:
        """See :meth:`.GroupCommits.commit_accepted`."""
        GroupCommits.commit_accepted(grant, seq, msg_id, revision)

    async def commit_refused(self, grant: Grant, seq: int, exc: APIError) -> bool:
        """See :meth:`.GroupCommits.commit_refused`."""
        return await self.commits.commit_refused(grant, seq, exc)

    async def set_blocked(self, partition: int, reason: str | None) -> None:
        """See :meth:`.GroupCommits.set_blocked`."""
        await self.commits.set_blocked(partition, reason)

    # status (.status)

    async def snapshot(self) -> GroupState:
        """See :meth:`.GroupSnapshot.snapshot`."""
        return await self.snapshots.snapshot()

    # the assignment and rebalance policy (.assignment)

    async def read_assignment(self) -> tuple[bytes | None, int]:
        """See :meth:`.GroupAssignment.read_assignment`."""
        return await self.assignments.read_assignment()

    async def write_assignment(self, data: bytes, last: int) -> int | None:
        """See :meth:`.GroupAssignment.write_assignment`."""
        return await self.assignments.write_assignment(data, last)

    async def read_policy(self) -> tuple[RebalancePolicy, int]:
        """See :meth:`.GroupAssignment.read_policy`."""
        return await self.assignments.read_policy()

    async def write_policy(self, policy: RebalancePolicy, last: int) -> int | None:
        """See :meth:`.GroupAssignment.write_policy`."""
        return await self.assignments.write_policy(policy, last)
