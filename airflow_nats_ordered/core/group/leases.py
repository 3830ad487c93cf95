"""Partition and membership leases: claim, renew, release, heartbeat (keys of the lease bucket).

Guarantees: a lease is claimed with ``create``, renewed with ``update(last=revision)`` and
released with ``delete(last=revision)``, never decided from a plain ``get``; a member treats
it as lost at (time the claim or renewal was *sent* + TTL - margin) on the monotonic clock,
so it never believes in a lease the server may already have expired. A failed
compare-and-set is checked against the key's latest value (read from the stream leader): if
it still carries this claim's nonce, the lost reply of an applied write is adopted, never a
newer owner's lease. :class:`GroupLeases` holds these verbs; :class:`~.store.GroupStore` has
one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.kv import compact_json, latest_entry
from airflow_nats_ordered.core.stream.layout import state_key


class LeaseLost(NatsOrderedError):
    """A lease could not be renewed (expired, or taken by another member)."""


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


class GroupLeases:
    """The lease verbs on a group's lease bucket ``leases``.

    ``epoch`` gives the layout epoch the group works on now (its partition keys are that
    epoch's, see :func:`~..stream.layout.state_key`): the store's, which moves when the
    group moves to another layout."""

    def __init__(
        self, nc: NATS, cfg: GroupConfig, leases: KeyValue, epoch: Callable[[], int]
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.leases = leases
        self.epoch = epoch

    def _deadline(self, sent: float) -> float:
        return sent + self.cfg.lease_ttl - self.cfg.safety_margin

    @staticmethod
    def _lease_value(lease: Lease, count: int) -> bytes:
        return compact_json({"member": lease.member, "claim": lease.claim, "n": count})

    async def _ours(self, lease: Lease) -> tuple[int, int] | None:
        """``(revision, renewal count)`` of ``lease.key`` if its current value is one of our
        own writes (same claim nonce), read from the stream leader; None if it is gone or
        someone else's."""
        found = await latest_entry(self.nc, self.cfg.lease_bucket, lease.key)
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
            if await _delete_at(self.leases, lease.key, lease.revision):
                return
            ours = await self._ours(lease)
            if ours is None:
                return
            lease.revision, lease.count = ours

    async def heartbeat(self, member: str, lease: Lease | None, info: dict[str, Any]) -> Lease:
        """Create or renew the member's ``m.<id>`` key (a lease on membership).

        The value carries the lease's claim nonce, so :meth:`release` recognises a
        heartbeat of ours whose reply was lost (one in flight when the member left) and
        deletes it: a member that left is not listed as alive until its TTL runs out."""
        key = f"m.{member}"
        claim = lease.claim if lease is not None and lease.valid else uuid.uuid4().hex
        payload = compact_json({**info, "member": member, "ts": time.time(), "claim": claim})
        sent = time.monotonic()
        if lease is None or not lease.valid:
            try:
                rev = await self.leases.create(key, payload)
            except KeyWrongLastSequenceError:
                # a previous incarnation with the same id: take its key over
                entry = await self.leases.get(key)
                rev = await self.leases.update(key, payload, last=entry.revision)
            return Lease(key, member, rev, self._deadline(sent), claim=claim)
        try:
            rev = await self.leases.update(key, payload, last=lease.revision)
        except KeyWrongLastSequenceError:
            return await self.heartbeat(member, None, info)
        lease.revision = rev
        lease.valid_until = self._deadline(sent)
        return lease

    async def take_lease_from(self, partition: int, claim: str | None) -> None:
        """Delete partition's lease while it is still the claim ``claim`` (renewals of it
        change its revision, not its claim); never a newer owner's lease."""
        key = state_key(self.epoch(), "p", partition)
        for _ in range(5):
            cur = await latest_entry(self.nc, self.cfg.lease_bucket, key)
            if cur is None or cur[0] is None or json.loads(cur[0]).get("claim") != claim:
                return
            if await _delete_at(self.leases, key, cur[1]):
                return
            # renewed meanwhile: read again


async def _delete_at(kv: KeyValue, key: str, revision: int) -> bool:
    """Delete ``key`` if its last revision is still ``revision``; False if it changed.

    nats-py's ``KeyValue.delete`` does not translate the server's wrong-last-sequence
    refusal (err_code 10071, or 10164 on some servers) into ``KeyWrongLastSequenceError``
    as ``update`` does: it raises the plain ``BadRequestError``."""
    try:
        await kv.delete(key, last=revision)
        return True
    except KeyWrongLastSequenceError:
        return False
    except APIError as exc:
        if exc.err_code in (10071, 10164):
            return False
        raise
