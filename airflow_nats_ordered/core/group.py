"""A consumer group's shared state in two KV buckets: leases and commits.

``<lease bucket>`` (TTL = the group's lease TTL, so expiry is decided by the server):
    ``p.<n>``       the lease of partition n: ``{"member": id}``
    ``m.<member>``  a member's heartbeat: ``{"member", "host", "pid", "started", "ts"}``
    ``leader``      the leader lease: the member that computes the assignment
``<state bucket>`` (no TTL):
    ``c.<n>``       partition n's committed position and fencing token:
                    ``{"seq", "token", "member", "ts"}``
    ``assignment``  the current assignment (generation, partition -> member)
    ``blocked.<n>`` why partition n is blocked (poison policy ``block``)

Leases are claimed with ``create``, renewed with ``update(last=revision)`` and released
with ``delete(last=revision)``; a lease is treated as lost at (time the claim or renewal
was *sent* + TTL − margin) on the monotonic clock, so a member never believes in a lease
the server may already have expired. Ownership is never decided from a plain ``get``.

Fencing: after claiming a partition's lease, the new owner bumps the token stored in
``c.<n>`` by compare-and-set, so every grant's token is larger than every earlier grant's,
and any later commit by a previous owner (which still holds the old revision) fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from .errors import ConfigError, NatsOrderedError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class LeaseLost(NatsOrderedError):
    """A lease could not be renewed (expired, or taken by another member)."""


class Fenced(NatsOrderedError):
    """A newer owner bumped the partition's fencing token: this owner must stop."""


def default_member_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class GroupConfig:
    """Where a group keeps its state and how long its leases live.

    ``lease_ttl`` is enforced by the server (bucket max age); ``margin`` is subtracted on
    the member's side so it stops before the server could hand the lease to someone else.
    """

    stream: str
    group: str
    lease_ttl: float = 5.0
    margin: float | None = None
    replicas: int = 1

    def __post_init__(self) -> None:
        if not _NAME.match(self.group or ""):
            raise ConfigError(
                f"group name {self.group!r} is not valid: 1-64 letters, digits, '_' or '-'"
            )
        if not 0.5 <= self.lease_ttl <= 3600:
            raise ConfigError(f"lease TTL must be 0.5 to 3600 seconds, got {self.lease_ttl!r}")

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
    key: str
    member: str
    revision: int
    valid_until: float  # monotonic

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


@dataclass(frozen=True)
class CommitRecord:
    seq: int
    token: int
    member: str
    ts: float


@dataclass
class GroupState:
    """A snapshot for ``status``: read with plain gets, never used for ownership."""

    leases: dict[int, tuple[str, int]] = field(default_factory=dict)  # p -> (member, rev)
    commits: dict[int, CommitRecord] = field(default_factory=dict)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    leader: str | None = None
    assignment: bytes | None = None
    blocked: dict[int, str] = field(default_factory=dict)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class GroupStore:
    """The two buckets of one group and the operations on them."""

    def __init__(self, nc: NATS, cfg: GroupConfig, leases: KeyValue, state: KeyValue) -> None:
        self.nc = nc
        self.cfg = cfg
        self.leases = leases
        self.state = state

    @classmethod
    async def attach(cls, nc: NATS, stream: str, group: str) -> GroupStore:
        """Open an existing group's buckets with the lease TTL it uses (for ``status``)."""
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
        return cls(nc, GroupConfig(stream, group, lease_ttl=ttl), leases, state)

    @classmethod
    async def open(cls, nc: NATS, cfg: GroupConfig, create: bool = True) -> GroupStore:
        """Open (or create) the group's buckets; refuse a lease TTL that differs."""
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
                    replicas=cfg.replicas,
                    storage=api.StorageType.FILE,
                    description=f"nats-ordered leases of group {cfg.group} on {cfg.stream}",
                )
            )
        try:
            state = await js.key_value(cfg.state_bucket)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise
            state = await js.create_key_value(
                api.KeyValueConfig(
                    bucket=cfg.state_bucket,
                    history=1,
                    replicas=cfg.replicas,
                    storage=api.StorageType.FILE,
                    description=f"nats-ordered commits of group {cfg.group} on {cfg.stream}",
                )
            )
        return cls(nc, cfg, leases, state)

    # -- leases --------------------------------------------------------------------------------
    def _deadline(self, sent: float) -> float:
        return sent + self.cfg.lease_ttl - self.cfg.safety_margin

    async def acquire(self, key: str, member: str) -> Lease | None:
        """Claim ``key`` if nobody holds it; None if it is held."""
        sent = time.monotonic()
        try:
            rev = await self.leases.create(key, _dump({"member": member}))
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            # held; or (a nats-py race) it expired between create's two steps: retry later
            return None
        return Lease(key, member, rev, self._deadline(sent))

    async def renew(self, lease: Lease) -> Lease:
        """Extend a lease by compare-and-set; raises LeaseLost if it is no longer ours."""
        if not lease.valid:
            raise LeaseLost(f"lease {lease.key} expired locally before it could be renewed")
        sent = time.monotonic()
        try:
            rev = await self.leases.update(
                lease.key, _dump({"member": lease.member}), last=lease.revision
            )
        except KeyWrongLastSequenceError as exc:
            raise LeaseLost(f"lease {lease.key} was lost (expired or taken over)") from exc
        lease.revision = rev
        lease.valid_until = self._deadline(sent)
        return lease

    async def release(self, lease: Lease) -> None:
        """Give a lease back at once (no TTL wait); a no-op if it was already lost."""
        lease.valid_until = 0.0
        try:
            await self.leases.delete(lease.key, last=lease.revision)
        except KeyWrongLastSequenceError:
            pass
        except Exception as exc:  # an APIError for the wrong-last case on some servers
            if getattr(exc, "err_code", None) not in (10071, 10164):
                raise

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
    async def _read_commit(self, partition: int) -> tuple[CommitRecord | None, int]:
        try:
            e = await self.state.get(f"c.{partition}")
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        d = json.loads(e.value or b"{}")
        return CommitRecord(int(d["seq"]), int(d["token"]), d.get("member", ""), d.get("ts", 0)), (
            e.revision or 0
        )

    async def grant(self, partition: int, member: str) -> Grant:
        """Bump the partition's fencing token (CAS) for a member that holds its lease."""
        for _ in range(20):
            rec, rev = await self._read_commit(partition)
            seq = rec.seq if rec else 0
            token = (rec.token if rec else 0) + 1
            value = _dump({"seq": seq, "token": token, "member": member, "ts": time.time()})
            try:
                if rec is None and rev == 0:
                    new_rev = await self.state.create(f"c.{partition}", value)
                else:
                    new_rev = await self.state.update(f"c.{partition}", value, last=rev)
            except KeyWrongLastSequenceError:
                continue  # a previous owner committed meanwhile: read again
            return Grant(partition, token, seq, new_rev, member)
        raise NatsOrderedError(f"could not bump the fencing token of partition {partition}")

    async def commit(self, grant: Grant, seq: int) -> None:
        """Record ``seq`` as processed, by CAS on the grant's revision; raises Fenced if a
        newer owner has bumped the token since."""
        if seq <= grant.committed:
            return
        value = _dump({"seq": seq, "token": grant.token, "member": grant.member, "ts": time.time()})
        try:
            grant.revision = await self.state.update(
                f"c.{grant.partition}", value, last=grant.revision
            )
        except KeyWrongLastSequenceError as exc:
            raise Fenced(
                f"partition {grant.partition}: token {grant.token} was fenced off by a newer "
                "owner; this member stops processing it"
            ) from exc
        grant.committed = seq

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

    async def set_blocked(self, partition: int, reason: str | None) -> None:
        key = f"blocked.{partition}"
        if reason is None:
            with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
                await self.state.delete(key)
        else:
            await self.state.put(key, reason.encode())

    # -- snapshot ------------------------------------------------------------------------------
    async def snapshot(self) -> GroupState:
        snap = GroupState()
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
                        d = json.loads(val)
                        snap.commits[int(key[2:])] = CommitRecord(
                            int(d["seq"]), int(d["token"]), d.get("member", ""), d.get("ts", 0)
                        )
                    elif key == "assignment":
                        snap.assignment = val
                    elif key.startswith("blocked."):
                        snap.blocked[int(key[8:])] = val.decode()
        return snap
