"""Committed positions and fencing tokens: a partition's commit record ``c.<n>`` and its
blocked marker ``blocked.<n>`` in the group's state bucket.

Guarantees: after claiming a partition's lease, the new owner bumps the token in ``c.<n>`` by
compare-and-set (:meth:`GroupCommits.grant`), so every grant's token is larger than every
earlier grant's and any later commit by a previous owner fails (:class:`Fenced`). A new token
is ``max(previous + 1, floor + 1, now in ms)`` (:func:`next_token`): it stays larger than
every earlier one even when ``c.<n>`` is deleted or the bucket re-created. A commit record
that disappeared is never silently taken as "start from the beginning": the group's
``missing_commit`` policy decides (:class:`CommitRecordMissing` by default). A failed
compare-and-set that still carries this owner's token is the lost reply of an applied
write, and is adopted. :class:`GroupCommits` holds these verbs; :class:`~.store.GroupStore`
has one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import (
    APIError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.connection.api import jetstream, kv_subject
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.cas_writes import Answer, CasWrites
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.leases import GroupLeases
from airflow_nats_ordered.core.group.stream_identity import GroupStreamIdentity, StreamRecreated
from airflow_nats_ordered.core.stream.continuity import AtSeq
from airflow_nats_ordered.core.stream.kv import compact_json, latest_entry
from airflow_nats_ordered.core.stream.layout import state_key
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, partition_bounds

log = logging.getLogger(__name__)


class Fenced(NatsOrderedError):
    """A newer owner bumped the partition's fencing token: this owner must stop."""


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
    #: the layout epoch of the partition (its commit record is ``state_key(epoch, "c", n)``)
    epoch: int = 0


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
    return compact_json(d)


class GroupCommits:
    """The commit and fencing verbs on a group's state bucket ``state``, for the ``stream``
    the group's store was opened on. A grant checks the stream's ``identity`` first, and a
    reset takes the holder's lease away (``leasing``).

    ``epoch`` gives the layout epoch the group works on now (its commit records and blocked
    markers are that epoch's, see :func:`~..stream.layout.state_key`): the store's, which
    moves when the group moves to another layout."""

    def __init__(
        self,
        nc: NATS,
        cfg: GroupConfig,
        state: KeyValue,
        stream: PartitionedStream | None,
        identity: GroupStreamIdentity,
        leasing: GroupLeases,
        epoch: Callable[[], int],
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.state = state
        self.stream = stream
        self.identity = identity
        self.leasing = leasing
        self.epoch = epoch
        #: the pipelined commit writes of the connection (created on first use)
        self._cas: CasWrites | None = None

    async def read_commit(self, partition: int) -> tuple[CommitRecord | None, int]:
        """Partition's commit record and its revision, read from the stream leader.
        A deleted record gives ``(None, revision of the delete marker)``, a record never
        written ``(None, 0)``."""
        key = state_key(self.epoch(), "c", partition)
        found = await latest_entry(self.nc, self.cfg.state_bucket, key)
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
        live = await self.identity.check_stream()
        key = state_key(self.epoch(), "c", partition)
        for _ in range(20):
            rec, rev = await self.read_commit(partition)
            if rec is not None and rec.stream and live.created and rec.stream != live.created:
                raise StreamRecreated(self.identity.recreated_message(rec.stream, live.created))
            msg_id = ""
            # a sink's floor says a record existed only in the stream's oldest layout epoch:
            # in a later one the sink has seen tokens of the earlier layout's partition of
            # that number, and a group that lost its state starts at the oldest epoch again
            floor_says = floor > 0 and self.epoch() <= live.oldest_epoch
            if rec is None and (rev > 0 or floor_says):
                seq = await self._resume_without_record(live, partition, rev, floor)
            else:
                seq, msg_id = (rec.seq, rec.msg_id) if rec else (0, "")
            token = next_token(rec.token if rec else 0, floor, time.time_ns() // 1_000_000)
            value = _commit_value(seq, token, member, live.created, msg_id)
            try:
                new_rev = await self._put_commit(key, value, rev)
            except KeyWrongLastSequenceError:
                continue  # a previous owner committed meanwhile: read again
            return Grant(partition, token, seq, new_rev, member, live.created, msg_id, self.epoch())
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
            f"its commit record {state_key(self.epoch(), 'c', partition)} was deleted or purged"
            if marker_rev
            else f"the sink has seen fencing token {floor} for it but the group has no commit "
            f"record {state_key(self.epoch(), 'c', partition)} (the state bucket "
            f"{c.state_bucket} was re-created or purged)"
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
        live = await self.identity.check_stream()
        key = state_key(self.epoch(), "c", partition)
        # the lease as it is before the new token: only that holder is taken away (a new
        # owner claiming after the reset keeps its lease)
        held = await latest_entry(
            self.nc, self.cfg.lease_bucket, state_key(self.epoch(), "p", partition)
        )
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
                await self.leasing.take_lease_from(partition, json.loads(held[0]).get("claim"))
            return (rec.seq if rec else 0), token
        raise NatsOrderedError(f"could not reset partition {partition}: its record keeps changing")

    async def stored_at(self, seq: int) -> AtSeq:
        """What the stream holds at ``seq`` now, read from its leader: its last sequence,
        and the subject and Nats-Msg-Id of the message stored at ``seq`` (if one is)."""
        assert self.stream is not None
        js = jetstream(self.nc)
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
        key = state_key(grant.epoch, "c", grant.partition)
        value = _commit_value(seq, grant.token, grant.member, grant.stream, msg_id or "")
        for _ in range(5):
            try:
                grant.revision = await self.state.update(key, value, last=grant.revision)
                grant.committed, grant.committed_id = seq, msg_id or ""
                return
            except KeyWrongLastSequenceError as exc:
                if await self.commit_refused(grant, seq, exc):
                    return  # this very write was applied; only its reply was lost
        raise Fenced(
            f"partition {grant.partition}: the commit record keeps changing under token "
            f"{grant.token} (two tasks committing one grant?); this member stops processing it"
        )

    async def send_commit(
        self, grant: Grant, seq: int, msg_id: str | None, answer: Answer, timeout: float
    ) -> None:
        """The write :meth:`commit` makes (CAS on the grant's revision), put on the wire
        without waiting: ``answer`` gets the new revision (then record it with
        :meth:`commit_accepted`) or why there is none (see :meth:`commit_refused`)."""
        if self._cas is None:
            self._cas = CasWrites(self.nc)
        key = state_key(grant.epoch, "c", grant.partition)
        value = _commit_value(seq, grant.token, grant.member, grant.stream, msg_id or "")
        await self._cas.send(
            kv_subject(self.nc, self.cfg.state_bucket, key), value, grant.revision, answer, timeout
        )

    @staticmethod
    def commit_accepted(grant: Grant, seq: int, msg_id: str | None, revision: int) -> None:
        """Record in ``grant`` that the write of ``seq`` was stored at ``revision``."""
        grant.revision = revision
        grant.committed, grant.committed_id = seq, msg_id or ""

    async def commit_refused(self, grant: Grant, seq: int, exc: APIError) -> bool:
        """After :meth:`send_commit`'s write of ``seq`` failed its compare-and-set, check the
        record as :meth:`commit` does: a newer token raises :class:`Fenced`; this grant's
        own token at another revision (the reply of an earlier write was lost) is adopted,
        and gives True if the record holds ``seq`` or later, else False (send the write
        again)."""
        rec, rev = await self.read_commit(grant.partition)
        if rec is None or rec.token != grant.token or rec.member != grant.member:
            raise Fenced(
                f"partition {grant.partition}: token {grant.token} was fenced off by a "
                "newer owner; this member stops processing it"
            ) from exc
        grant.revision = rev
        if rec.seq >= seq:  # this very write was applied; only its reply was lost
            grant.committed, grant.committed_id = rec.seq, rec.msg_id
            return True
        return False

    async def set_blocked(self, partition: int, reason: str | None) -> None:
        key = state_key(self.epoch(), "blocked", partition)
        if reason is None:
            # only an existing marker is deleted: every claim clears it, and a needless
            # delete marker would wake every drain watcher of the group
            with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
                await self.state.get(key)
                await self.state.delete(key)
        else:
            await self.state.put(key, reason.encode())
