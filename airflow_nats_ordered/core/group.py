"""A consumer group's shared state in two KV buckets: leases and commits.

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
token is ``max(previous + 1, floor + 1, now in ms)`` (:func:`next_token`): it stays larger
than every earlier one even when ``c.<n>`` is deleted or the bucket re-created (the sink's
``floor``, or else the wall clock, is above every token issued before).

A compare-and-set that fails is not taken as proof of a newer owner: the record is read
again (from the stream leader) and, if it still carries this owner's token (commits) or
claim nonce (leases), the lost reply of an applied write is adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from .continuity import AtSeq
from .errors import ConfigError, NatsOrderedError, StreamNotFoundError
from .streams import PartitionedStream, describe, partition_bounds

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KV_OP = "KV-Operation"
MissingCommitPolicy = Literal["fail", "earliest", "latest"]
MISSING_COMMIT_POLICIES: tuple[str, ...] = ("fail", "earliest", "latest")


class LeaseLost(NatsOrderedError):
    """A lease could not be renewed (expired, or taken by another member)."""


class Fenced(NatsOrderedError):
    """A newer owner bumped the partition's fencing token: this owner must stop."""


class StreamRecreated(NatsOrderedError):
    """The stream was deleted and created again since the group recorded its positions:
    they (and the sink's last sequences) refer to the old stream's sequence numbers."""


class StateWentBack(NatsOrderedError):
    """A recorded position (the group's commit, the sink's applied position, the reader's
    position) is not part of the stream's history any more: the servers' stored state went
    back and the stream hands out its sequences again (see :mod:`.continuity`).
    ``last_seq`` is the stream's last sequence when it was found."""

    def __init__(self, message: str, last_seq: int = 0) -> None:
        super().__init__(message)
        self.last_seq = last_seq


class CommitRecordMissing(NatsOrderedError):
    """A partition that had a commit record has none any more, and the group's
    ``missing_commit`` policy is ``fail``."""

    def __init__(self, message: str, partition: int) -> None:
        super().__init__(message)
        self.partition = partition


def next_token(previous: int, floor: int, now_ms: int) -> int:
    """The next fencing token: larger than ``previous`` (the token in the commit record, 0
    if there is none) and than ``floor`` (the highest token the sink has seen), and at least
    the wall clock in milliseconds, so it exceeds every earlier token even when the commit
    record and the sink's floor are both unknown (as long as members' clocks agree to
    within the time since the last grant)."""
    return max(previous + 1, floor + 1, now_ms)


def default_member_id() -> str:
    """``<short host name>-<pid>``: unique per process, and without dots (a member id is a
    KV key token), even on a host whose name is a dotted FQDN."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


@dataclass(frozen=True)
class GroupConfig:
    """Where a group keeps its state and how long its leases live.

    ``lease_ttl`` is enforced by the server (bucket max age); ``margin`` is subtracted on
    the member's side so it stops before the server could hand the lease to someone else.
    ``replicas`` of both buckets: ``None`` takes the stream's replica count. ``missing_commit``
    decides where a partition resumes when its commit record disappeared although it had
    one (Kafka's ``auto.offset.reset``): ``fail`` refuses the partition, ``earliest``
    re-reads it from its first message still in the stream, ``latest`` skips to after its
    last message. A partition of a brand-new group starts at its beginning in every case.
    """

    stream: str
    group: str
    lease_ttl: float = 5.0
    margin: float | None = None
    replicas: int | None = None
    missing_commit: MissingCommitPolicy = "fail"

    def __post_init__(self) -> None:
        if not _NAME.match(self.group or ""):
            raise ConfigError(
                f"group name {self.group!r} is not valid: 1-64 letters, digits, '_' or '-'"
            )
        if not 0.5 <= self.lease_ttl <= 3600:
            raise ConfigError(f"lease TTL must be 0.5 to 3600 seconds, got {self.lease_ttl!r}")
        if self.replicas is not None and self.replicas not in (1, 2, 3, 4, 5):
            raise ConfigError(
                f"replicas must be 1 to 5 (or None: the stream's), got {self.replicas!r}"
            )
        if self.missing_commit not in MISSING_COMMIT_POLICIES:
            raise ConfigError(
                f"missing_commit must be one of {', '.join(MISSING_COMMIT_POLICIES)}, "
                f"got {self.missing_commit!r}"
            )

    @property
    def safety_margin(self) -> float:
        return self.margin if self.margin is not None else min(1.0, self.lease_ttl * 0.2)

    @property
    def renew_interval(self) -> float:
        return self.lease_ttl / 4

    @property
    def lease_bucket(self) -> str:
        return f"nor_{self.stream}_{self.group}_leases"

    @property
    def state_bucket(self) -> str:
        return f"nor_{self.stream}_{self.group}_state"


@dataclass
class Lease:
    """A lease held by ``member``. ``claim`` (a nonce per claim) and ``count`` (renewals
    so far) make every value written unique, so a re-read can recognise our own write."""

    key: str
    member: str
    revision: int
    valid_until: float  # monotonic
    claim: str = ""
    count: int = 0

    @property
    def valid(self) -> bool:
        return time.monotonic() < self.valid_until


@dataclass
class Grant:
    """Ownership of a partition: its fencing token and the commit record's revision."""

    partition: int
    token: int
    committed: int
    revision: int
    member: str
    stream: str = ""  # identity of the stream the position refers to (its creation time)
    #: the Nats-Msg-Id of the message at ``committed`` ("" if unknown)
    committed_id: str = ""


@dataclass(frozen=True)
class CommitRecord:
    seq: int
    token: int
    member: str
    ts: float
    stream: str = ""
    #: the Nats-Msg-Id of the message at ``seq`` ("" if unknown, or an older record)
    msg_id: str = ""

    @classmethod
    def from_json(cls, data: bytes | None) -> CommitRecord:
        d = json.loads(data or b"{}")
        return cls(
            int(d["seq"]),
            int(d["token"]),
            d.get("member", ""),
            d.get("ts", 0),
            d.get("stream", ""),
            d.get("id") or "",
        )


@dataclass
class RebalancePolicy:
    """What the leader balances by, kept in the state bucket (key ``policy``).

    ``cordon``: members that get no partitions; ``weights``: per-partition load (balance by
    load, not count); ``slack``: how far above the average load a member may stay, used once
    for the request ``request`` (an explicit rebalance), after which the leader's periodic
    recomputation uses the default (a fixed point, so nothing churns). ``applied`` is the
    last request the leader has applied, ``error`` why it could not obey it, if so."""

    cordon: list[str] = field(default_factory=list)
    weights: dict[int, float] = field(default_factory=dict)
    slack: float | None = None
    request: str = ""
    applied: str = ""
    #: why the leader could not obey the request it applied last ("" if it did)
    error: str = ""

    @property
    def pending(self) -> bool:
        return bool(self.request) and self.request != self.applied

    def to_json(self) -> bytes:
        d = asdict(self)
        d["weights"] = {str(p): w for p, w in self.weights.items()}
        return _dump(d)

    @classmethod
    def from_json(cls, data: bytes | None) -> RebalancePolicy:
        d = json.loads(data or b"{}")
        return cls(
            cordon=[str(m) for m in d.get("cordon", [])],
            weights={int(p): float(w) for p, w in (d.get("weights") or {}).items()},
            slack=d.get("slack"),
            request=d.get("request", ""),
            applied=d.get("applied", ""),
            error=d.get("error", ""),
        )


@dataclass
class GroupState:
    """A snapshot for ``status``: read with plain gets, never used for ownership."""

    leases: dict[int, tuple[str, int]] = field(default_factory=dict)  # p -> (member, rev)
    commits: dict[int, CommitRecord] = field(default_factory=dict)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    leader: str | None = None
    assignment: bytes | None = None
    blocked: dict[int, str] = field(default_factory=dict)
    #: what needs an operator: deleted commit records, a re-created stream, and each
    #: member's own ``problems`` (from its heartbeat) prefixed with the member id
    problems: list[str] = field(default_factory=list)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _commit_value(seq: int, token: int, member: str, stream: str, msg_id: str = "") -> bytes:
    """A partition's commit record (see :class:`CommitRecord`)."""
    d: dict[str, Any] = {
        "seq": seq,
        "token": token,
        "member": member,
        "ts": time.time(),
        "stream": stream,
    }
    if msg_id:
        d["id"] = msg_id
    return _dump(d)


class GroupStore:
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
        return cls(nc, GroupConfig(stream, group, lease_ttl=ttl), leases, state, live)

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
                    f"same TTL: pass --lease-ttl {ttl:g}"
                )
            await _ensure_replicas(nc, cfg.lease_bucket, replicas, explicit=explicit)
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
            await _ensure_replicas(nc, cfg.state_bucket, replicas, explicit=explicit)
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

    # -- the stream's identity -------------------------------------------------------------------
    async def _record_stream(self, stream: PartitionedStream) -> None:
        """Record the stream's identity in the state bucket, or check it against the one
        recorded; raises StreamRecreated if they differ. Rides out the moments after a
        bucket is created in a cluster, before its leader and subject interest are known."""
        value = _dump({"name": stream.name, "created": stream.created})
        deadline = time.monotonic() + 10.0
        while True:
            try:
                found = await _latest(self.nc, self.cfg.state_bucket, "stream")
                if found is not None and found[0] is not None:
                    recorded = json.loads(found[0]).get("created", "")
                    if recorded and stream.created and recorded != stream.created:
                        raise StreamRecreated(self._recreated_message(recorded, stream.created))
                    return
                if found is None:
                    await self.state.create("stream", value)
                else:  # a delete marker
                    await self.state.update("stream", value, last=found[1])
                return
            except KeyWrongLastSequenceError:
                continue  # another member recorded it meanwhile: check theirs
            except (NoStreamResponseError, ServiceUnavailableError, NatsTimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def _recreated_message(self, recorded: str, now: str) -> str:
        c = self.cfg
        return (
            f"stream {c.stream} was deleted and created again (group {c.group} recorded a "
            f"stream created at {recorded}; the stream now was created at {now}): the group's "
            "committed positions and fencing tokens, and the sink's last applied sequences, "
            "refer to the old stream's sequence numbers, so resuming would skip new messages "
            f"silently. Reset the group (`nats-ordered group delete --stream {c.stream} "
            f"--group {c.group}`) and reset the sink's state for this stream and group, then "
            "start the workers again."
        )

    async def check_stream(self) -> PartitionedStream:
        """Describe the stream now; raises StreamRecreated if it is not the stream this
        store was opened on (deleted and created again under the same name)."""
        live = await describe(self.nc, self.cfg.stream)
        opened = self.stream.created if self.stream is not None else ""
        if opened and live.created and opened != live.created:
            raise StreamRecreated(self._recreated_message(opened, live.created))
        return live

    # -- leases --------------------------------------------------------------------------------
    def _deadline(self, sent: float) -> float:
        return sent + self.cfg.lease_ttl - self.cfg.safety_margin

    @staticmethod
    def _lease_value(lease: Lease, count: int) -> bytes:
        return _dump({"member": lease.member, "claim": lease.claim, "n": count})

    async def _ours(self, lease: Lease) -> tuple[int, int] | None:
        """``(revision, renewal count)`` of ``lease.key`` if its current value is one of our
        own writes (same claim nonce), read from the stream leader; None if it is gone or
        someone else's."""
        found = await _latest(self.nc, self.cfg.lease_bucket, lease.key)
        if found is None or found[0] is None or not lease.claim:
            return None
        d = json.loads(found[0])
        if d.get("claim") != lease.claim:
            return None
        return found[1], int(d.get("n", 0))

    async def acquire(self, key: str, member: str) -> Lease | None:
        """Claim ``key`` if nobody holds it; None if it is held."""
        lease = Lease(key, member, 0, 0.0, claim=uuid.uuid4().hex)
        sent = time.monotonic()
        try:
            lease.revision = await self.leases.create(key, self._lease_value(lease, 0))
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            # held; or (a nats-py race) it expired between create's two steps: retry later
            return None
        lease.valid_until = self._deadline(sent)
        return lease

    async def renew(self, lease: Lease) -> Lease:
        """Extend a lease by compare-and-set; raises LeaseLost if it is no longer ours.

        If the revision is stale because the reply of an earlier renewal was lost although
        the server applied it, the key still holds our claim: the revision is adopted and
        the renewal sent again (the deadline counts from that send)."""
        for _ in range(3):
            if not lease.valid:
                raise LeaseLost(f"lease {lease.key} expired locally before it could be renewed")
            sent = time.monotonic()
            try:
                rev = await self.leases.update(
                    lease.key, self._lease_value(lease, lease.count + 1), last=lease.revision
                )
            except KeyWrongLastSequenceError as exc:
                ours = await self._ours(lease)
                if ours is None:
                    raise LeaseLost(f"lease {lease.key} was lost (expired or taken over)") from exc
                # our own write, applied but its reply lost: adopt it and renew again now
                lease.revision, lease.count = ours
                continue
            lease.revision = rev
            lease.count += 1
            lease.valid_until = self._deadline(sent)
            return lease
        raise LeaseLost(f"lease {lease.key} could not be renewed (its revision kept changing)")

    async def release(self, lease: Lease) -> None:
        """Give a lease back at once (no TTL wait); a no-op if it was already lost. A stale
        revision (a lost reply of an applied renewal) does not keep the lease held."""
        lease.valid_until = 0.0
        for _ in range(2):
            try:
                await self.leases.delete(lease.key, last=lease.revision)
                return
            except KeyWrongLastSequenceError:
                pass
            except Exception as exc:  # an APIError for the wrong-last case on some servers
                if getattr(exc, "err_code", None) not in (10071, 10164):
                    raise
            ours = await self._ours(lease)
            if ours is None:
                return
            lease.revision, lease.count = ours

    async def heartbeat(self, member: str, lease: Lease | None, info: dict[str, Any]) -> Lease:
        """Create or renew the member's ``m.<id>`` key (a lease on membership)."""
        key = f"m.{member}"
        payload = _dump({**info, "member": member, "ts": time.time()})
        sent = time.monotonic()
        if lease is None or not lease.valid:
            try:
                rev = await self.leases.create(key, payload)
            except KeyWrongLastSequenceError:
                # a previous incarnation with the same id: take its key over
                entry = await self.leases.get(key)
                rev = await self.leases.update(key, payload, last=entry.revision)
            return Lease(key, member, rev, self._deadline(sent))
        try:
            rev = await self.leases.update(key, payload, last=lease.revision)
        except KeyWrongLastSequenceError:
            return await self.heartbeat(member, None, info)
        lease.revision = rev
        lease.valid_until = self._deadline(sent)
        return lease

    # -- commits and fencing ----------------------------------------------------------------------
    async def read_commit(self, partition: int) -> tuple[CommitRecord | None, int]:
        """Partition's commit record and its revision, read from the stream leader.
        A deleted record gives ``(None, revision of the delete marker)``, a record never
        written ``(None, 0)``."""
        found = await _latest(self.nc, self.cfg.state_bucket, f"c.{partition}")
        if found is None:
            return None, 0
        data, rev = found
        return (CommitRecord.from_json(data) if data is not None else None), rev

    async def grant(self, partition: int, member: str, *, floor: int = 0) -> Grant:
        """Bump the partition's fencing token (CAS) for a member that holds its lease.

        The token is :func:`next_token` of the record's token and ``floor`` (the highest
        token the handler's sink has seen for this partition; 0 if unknown), so it is larger
        than every earlier token even if the record was deleted. If the partition had a
        record that is now missing (a delete marker, or ``floor > 0``), ``missing_commit``
        decides: CommitRecordMissing, or resume at the partition's earliest or latest
        message. Raises StreamRecreated if the stream is not the one the group's positions
        refer to."""
        live = await self.check_stream()
        key = f"c.{partition}"
        for _ in range(20):
            rec, rev = await self.read_commit(partition)
            if rec is not None and rec.stream and live.created and rec.stream != live.created:
                raise StreamRecreated(self._recreated_message(rec.stream, live.created))
            msg_id = ""
            if rec is None and (rev > 0 or floor > 0):
                seq = await self._resume_without_record(live, partition, rev, floor)
            else:
                seq, msg_id = (rec.seq, rec.msg_id) if rec else (0, "")
            token = next_token(rec.token if rec else 0, floor, time.time_ns() // 1_000_000)
            value = _commit_value(seq, token, member, live.created, msg_id)
            try:
                new_rev = await self._put_commit(key, value, rev)
            except KeyWrongLastSequenceError:
                continue  # a previous owner committed meanwhile: read again
            return Grant(partition, token, seq, new_rev, member, live.created, msg_id)
        raise NatsOrderedError(f"could not bump the fencing token of partition {partition}")

    async def _put_commit(self, key: str, value: bytes, rev: int) -> int:
        """Create the commit record (``rev`` 0) or replace it by CAS on ``rev``."""
        if rev == 0:
            return await self.state.create(key, value)
        return await self.state.update(key, value, last=rev)

    async def _resume_without_record(
        self, live: PartitionedStream, partition: int, marker_rev: int, floor: int
    ) -> int:
        """Where a partition whose commit record is missing resumes, by ``missing_commit``."""
        c = self.cfg
        why = (
            f"its commit record c.{partition} was deleted or purged"
            if marker_rev
            else f"the sink has seen fencing token {floor} for it but the group has no commit "
            f"record c.{partition} (the state bucket {c.state_bucket} was re-created or purged)"
        )
        if c.missing_commit == "fail":
            raise CommitRecordMissing(
                f"partition {partition} of group {c.group} on stream {c.stream}: {why}, so the "
                "position to resume from is unknown and it is not processed. Choose with "
                "missing_commit (CLI: --missing-commit): 'earliest' re-reads the partition "
                "from its first message still in the stream (the sink drops what it already "
                "applied), 'latest' resumes after the partition's last message now in the "
                "stream (messages stored before are not processed).",
                partition,
            )
        first, last = await partition_bounds(self.nc, live, partition)
        seq = max(0, first - 1) if c.missing_commit == "earliest" else last
        log.warning(
            "group %s, partition %d: %s; resuming after seq %d (missing_commit=%s)",
            c.group,
            partition,
            why,
            seq,
            c.missing_commit,
        )
        return seq

    async def reset(self, partition: int, seq: int, *, by: str = "reset") -> tuple[int, int]:
        """Set the partition's committed position to ``seq`` (the next message processed is
        the first after it), under a new fencing token: the current owner's next commit
        fails (Fenced) and its lease is taken away (so an idle owner notices at its next
        renewal), it stops and hands the partition over, and whoever claims it next resumes
        from ``seq``. Clears a ``blocked`` marker (a reset past a poison message is
        how an operator skips it). Returns ``(previous position, token)``."""
        live = await self.check_stream()
        key = f"c.{partition}"
        # the lease as it is before the new token: only that holder is taken away (a new
        # owner claiming after the reset keeps its lease)
        held = await _latest(self.nc, self.cfg.lease_bucket, f"p.{partition}")
        # the msg-id of the message at seq, so the position can be checked (continuity)
        at = await self.stored_at(seq) if seq > 0 else None
        msg_id = (at.msg_id or "") if at and at.subject == live.subject(partition) else ""
        for _ in range(20):
            rec, rev = await self.read_commit(partition)
            token = next_token(rec.token if rec else 0, 0, time.time_ns() // 1_000_000)
            value = _commit_value(seq, token, by, live.created, msg_id)
            try:
                await self._put_commit(key, value, rev)
            except KeyWrongLastSequenceError:
                continue  # the owner committed meanwhile: read again
            await self.set_blocked(partition, None)
            # take the lease away too: an idle owner would never commit, so never notice the
            # new token; its next renewal now fails and it hands the partition over
            if held is not None and held[0] is not None:
                await self._take_lease_from(partition, json.loads(held[0]).get("claim"))
            return (rec.seq if rec else 0), token
        raise NatsOrderedError(f"could not reset partition {partition}: its record keeps changing")

    async def _take_lease_from(self, partition: int, claim: str | None) -> None:
        """Delete partition's lease while it is still the claim ``claim`` (renewals of it
        change its revision, not its claim); never a newer owner's lease."""
        key = f"p.{partition}"
        for _ in range(5):
            cur = await _latest(self.nc, self.cfg.lease_bucket, key)
            if cur is None or cur[0] is None or json.loads(cur[0]).get("claim") != claim:
                return
            try:
                await self.leases.delete(key, last=cur[1])
                return
            except KeyWrongLastSequenceError:
                continue  # renewed meanwhile: read again

    async def stored_at(self, seq: int) -> AtSeq:
        """What the stream holds at ``seq`` now, read from its leader: its last sequence,
        and the subject and Nats-Msg-Id of the message stored at ``seq`` (if one is)."""
        assert self.stream is not None
        js = self.nc.jetstream()
        info = await js.stream_info(self.stream.name)
        last = int(info.state.last_seq or 0)
        if seq <= 0 or seq > last:
            return AtSeq(last)
        try:
            msg = await js.get_msg(self.stream.name, seq=seq)
        except NotFoundError:
            return AtSeq(last)  # deleted, aged out or purged
        return AtSeq(last, msg.subject or "", (msg.headers or {}).get("Nats-Msg-Id"))

    async def commit(self, grant: Grant, seq: int, msg_id: str | None = None) -> None:
        """Record ``seq`` (the message whose Nats-Msg-Id is ``msg_id``) as processed, by CAS
        on the grant's revision; raises Fenced if a newer owner has bumped the token since.

        A failed CAS is checked against the record: if it still carries this grant's token
        and member, nobody fenced us (the reply of one of our own writes was lost): its
        revision is adopted, and the write is sent again unless it already holds ``seq``."""
        if seq <= grant.committed:
            return
        key = f"c.{grant.partition}"
        value = _commit_value(seq, grant.token, grant.member, grant.stream, msg_id or "")
        for _ in range(5):
            try:
                grant.revision = await self.state.update(key, value, last=grant.revision)
                grant.committed, grant.committed_id = seq, msg_id or ""
                return
            except KeyWrongLastSequenceError as exc:
                rec, rev = await self.read_commit(grant.partition)
                if rec is None or rec.token != grant.token or rec.member != grant.member:
                    raise Fenced(
                        f"partition {grant.partition}: token {grant.token} was fenced off by a "
                        "newer owner; this member stops processing it"
                    ) from exc
                grant.revision = rev
                if rec.seq >= seq:  # this very write was applied; only its reply was lost
                    grant.committed, grant.committed_id = rec.seq, rec.msg_id
                    return
        raise Fenced(
            f"partition {grant.partition}: the commit record keeps changing under token "
            f"{grant.token} (two tasks committing one grant?); this member stops processing it"
        )

    # -- assignment ----------------------------------------------------------------------------
    async def read_assignment(self) -> tuple[bytes | None, int]:
        try:
            e = await self.state.get("assignment")
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        return e.value, e.revision or 0

    async def write_assignment(self, data: bytes, last: int) -> int | None:
        try:
            if last == 0:
                return await self.state.create("assignment", data)
            return await self.state.update("assignment", data, last=last)
        except KeyWrongLastSequenceError:
            return None

    async def read_policy(self) -> tuple[RebalancePolicy, int]:
        """The rebalance policy and its revision (an empty policy, revision 0, if none)."""
        try:
            e = await self.state.get("policy")
        except (KeyNotFoundError, KeyDeletedError):
            return RebalancePolicy(), 0
        return RebalancePolicy.from_json(e.value), e.revision or 0

    async def write_policy(self, policy: RebalancePolicy, last: int) -> int | None:
        """Write the policy by CAS on ``last`` (0: it must not exist); None if it changed."""
        try:
            if last == 0:
                return await self.state.create("policy", policy.to_json())
            return await self.state.update("policy", policy.to_json(), last=last)
        except KeyWrongLastSequenceError:
            return None

    async def set_blocked(self, partition: int, reason: str | None) -> None:
        key = f"blocked.{partition}"
        if reason is None:
            # only an existing marker is deleted: every claim clears it, and a needless
            # delete marker would wake every drain watcher of the group
            with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
                await self.state.get(key)
                await self.state.delete(key)
        else:
            await self.state.put(key, reason.encode())

    # -- snapshot ------------------------------------------------------------------------------
    async def snapshot(self) -> GroupState:
        """Read the group's state for ``status``, with ``problems`` an operator must act on."""
        snap = GroupState()
        recorded_stream = ""
        for kv, prefix in ((self.leases, "lease"), (self.state, "state")):
            try:
                keys = await kv.keys()
            except Exception:  # nats-py raises NoKeysError on an empty bucket
                keys = []
            for key in keys:
                try:
                    e = await kv.get(key)
                except (KeyNotFoundError, KeyDeletedError):
                    continue
                val = e.value or b""
                if prefix == "lease":
                    if key.startswith("p."):
                        snap.leases[int(key[2:])] = (json.loads(val)["member"], e.revision or 0)
                    elif key.startswith("m."):
                        snap.members[key[2:]] = json.loads(val)
                    elif key == "leader":
                        snap.leader = json.loads(val)["member"]
                else:
                    if key.startswith("c."):
                        snap.commits[int(key[2:])] = CommitRecord.from_json(val)
                    elif key == "assignment":
                        snap.assignment = val
                    elif key.startswith("blocked."):
                        snap.blocked[int(key[8:])] = val.decode()
                    elif key == "stream":
                        recorded_stream = json.loads(val).get("created", "")
        snap.problems = await self._stream_problems(recorded_stream)
        snap.problems += await self._deleted_commit_problems(snap.commits)
        for m, info in sorted(snap.members.items()):
            snap.problems += [f"{m}: {p}" for p in info.get("problems") or []]
        return snap

    async def _stream_problems(self, recorded: str) -> list[str]:
        try:
            live = await describe(self.nc, self.cfg.stream)
        except StreamNotFoundError:
            return [
                f"stream {self.cfg.stream} does not exist: the group's positions refer to a "
                f"deleted stream (remove the group: `nats-ordered group delete --stream "
                f"{self.cfg.stream} --group {self.cfg.group}`)"
            ]
        if recorded and live.created and recorded != live.created:
            return [self._recreated_message(recorded, live.created)]
        return []

    async def _deleted_commit_problems(self, commits: dict[int, CommitRecord]) -> list[str]:
        """Partitions whose ``c.<n>`` has a delete marker (it existed, then was deleted)."""
        prefix = f"$KV.{self.cfg.state_bucket}.c."
        info = await self.nc.jetstream().stream_info(
            f"KV_{self.cfg.state_bucket}", subjects_filter=f"{prefix}*"
        )
        gone = sorted(
            int(subject[len(prefix) :])
            for subject in info.state.subjects or {}
            if int(subject[len(prefix) :]) not in commits
        )
        return [
            f"partition {p}: commit record c.{p} was deleted; the member that claims it next "
            "applies its missing_commit policy: fail (the default: the partition is not "
            "processed), earliest or latest (--missing-commit earliest|latest)"
            for p in gone
        ]


async def _latest(nc: NATS, bucket: str, key: str) -> tuple[bytes | None, int] | None:
    """The latest entry of ``key`` read from the bucket's stream leader (never a possibly
    stale replica): ``(value, revision)``, ``(None, revision)`` for a delete or purge
    marker, or None if the key was never written (or its history was purged)."""
    try:
        msg = await nc.jetstream().get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except NotFoundError:
        return None
    op = (msg.headers or {}).get(_KV_OP)
    return (None if op in ("DEL", "PURGE") else (msg.data or b"")), int(msg.seq or 0)


async def _ensure_replicas(nc: NATS, bucket: str, replicas: int, *, explicit: bool) -> None:
    """Raise an existing bucket to ``replicas`` in place; never lower it. A member that
    asks for fewer on purpose (``explicit``) is refused: one member's setting must not take
    the whole group's state down to fewer copies."""
    js = nc.jetstream()
    info = await js.stream_info(f"KV_{bucket}")
    current = info.config.num_replicas or 1
    if current > replicas and explicit:
        raise ConfigError(
            f"the group's KV bucket {bucket} has {current} replicas but {replicas} were "
            f"requested (state_replicas, CLI --state-replicas): a member never lowers the "
            f"group's state for every member; drop the setting, or lower the bucket "
            f"deliberately (`nats stream edit KV_{bucket} --replicas {replicas}`)"
        )
    if current >= replicas:
        return
    info.config.num_replicas = replicas
    await js.update_stream(info.config)
    log.info("KV bucket %s now has %d replicas", bucket, replicas)
