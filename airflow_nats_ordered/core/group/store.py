"""The consumer group's store (:class:`GroupStore`): its two KV buckets and how they are opened.

Every verb on the group's state is a method of :class:`GroupStore`; each concept lives in
the module named after it, mixed into the store:

* :mod:`.config` - :class:`GroupConfig` (names, lease TTL, replicas, missing_commit)
* :mod:`.leases` - claim, renew, release, heartbeat (:class:`Lease`, :class:`LeaseLost`)
* :mod:`.commits` - commit records, fencing tokens, grant/commit/reset, blocked markers
  (:class:`Grant`, :class:`CommitRecord`, :class:`Fenced`, :func:`next_token`)
* :mod:`.stream_identity` - the stream's recorded identity (:class:`StreamRecreated`)
* :mod:`.assignment` - the assignment record and :class:`RebalancePolicy`
* :mod:`.status` - the ``status`` snapshot (:class:`GroupState`)
* :mod:`..stream.kv` - leader reads and bucket replicas

Every name above stays importable from this module.

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

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError, StreamNotFoundError
from airflow_nats_ordered.core.group.assignment import GroupAssignment, RebalancePolicy
from airflow_nats_ordered.core.group.commits import (
    CommitRecord,
    CommitRecordMissing,
    Fenced,
    Grant,
    GroupCommits,
    next_token,
)
from airflow_nats_ordered.core.group.config import (
    MISSING_COMMIT_POLICIES,
    GroupConfig,
    MissingCommitPolicy,
    default_member_id,
)
from airflow_nats_ordered.core.group.leases import Lease, LeaseLost
from airflow_nats_ordered.core.group.status import GroupSnapshot, GroupState
from airflow_nats_ordered.core.group.stream_identity import StateWentBack, StreamRecreated
from airflow_nats_ordered.core.stream.kv import ensure_replicas, latest_entry
from airflow_nats_ordered.core.stream.layout import GROUP_EPOCH_KEY, group_epoch_of
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, describe

__all__ = [
    "MISSING_COMMIT_POLICIES",
    "CommitRecord",
    "CommitRecordMissing",
    "Fenced",
    "Grant",
    "GroupConfig",
    "GroupState",
    "GroupStore",
    "Lease",
    "LeaseLost",
    "MissingCommitPolicy",
    "RebalancePolicy",
    "StateWentBack",
    "StreamRecreated",
    "default_member_id",
    "next_token",
]


class GroupStore(GroupCommits, GroupSnapshot, GroupAssignment):
    """The two buckets of one group and the operations on them.

    ``stream`` is the partitioned stream as described when the store was opened (``None``
    only for :meth:`attach` when the stream no longer exists)."""

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

    @classmethod
    async def attach(cls, nc: NATS, stream: str, group: str) -> GroupStore:
        """Open an existing group's buckets with the lease TTL it uses (for ``status``).

        Never refuses for the state of the stream (deleted, re-created): :meth:`snapshot`
        reports that in ``problems``."""
        js = nc.jetstream()
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
        js = nc.jetstream()
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
        await store._record_stream(stream)
        return store
