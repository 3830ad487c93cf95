"""The worker: a group member that owns partitions through leases and processes them in order.

Guarantees (each tested by breaking it in ``tests/test_worker_chaos.py``)
------------------------------------------------------------------------
* **Exclusive ownership.** A partition is processed only while its lease is valid, with
  validity measured from when the claim or renewal was *sent* (minus a safety margin), so
  a member stops before the server could grant the lease to anyone else.
* **Fencing.** Each grant bumps the partition's token by compare-and-set in the commit
  record; every message handed to the handler carries it (``Message.fencing_token``), and a
  previous owner's commits fail once a newer grant exists.
* **Order.** One task per partition reads it from the committed position with one reader,
  and calls the handler message by message (or batch by batch) in stream order.
* **At-least-once.** Positions are committed after the handler returned, every
  ``commit_every`` messages / ``commit_interval`` seconds and on hand-over, so a crash
  re-delivers at most the uncommitted tail; a fenced sink makes it effectively-once.
* **Cooperative, sticky rebalancing.** One member (the leader, itself a lease) computes the
  assignment with the sticky assignor; the others reconcile: only partitions that move are
  stopped (committed and released at once) and claimed by their new owner.
* **Graceful stop.** :meth:`Worker.stop` finishes the message in hand, commits, releases
  every lease and leaves the group, so hand-over does not wait for a TTL.
* **Fenced handlers stop.** A handler that raises :class:`Fenced` (its sink saw a newer
  token) stops the partition at once, without retrying, dead-lettering or committing.
* **Poison messages.** A failing handler is retried with backoff; then the message goes to
  the dead-letter subject with its headers and the error (and processing moves on), or the
  partition blocks and reports why (``poison="block"``). Never a silent skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    NotFoundError,
)

from .assignor import Assignment, assign
from .errors import ConfigError, NatsOrderedError
from .group import Fenced, Grant, GroupConfig, GroupStore, Lease, LeaseLost, default_member_id
from .partitioning import partition_subject
from .streams import PartitionedStream, describe

log = logging.getLogger(__name__)

HDR_ERROR = "Nats-Ordered-Error"
HDR_ORIGIN = "Nats-Ordered-Origin"


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler receives."""

    key: str
    data: bytes
    headers: dict[str, str]
    partition: int
    stream_seq: int
    fencing_token: int
    subject: str

    @property
    def producer_seq(self) -> int | None:
        v = self.headers.get("Nats-Ordered-Seq")
        return int(v) if v and v.isdigit() else None


Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Any]


@dataclass(frozen=True)
class WorkerConfig:
    """A member's settings; one home for the CLI, the Airflow adapters and tests."""

    stream: str
    group: str
    member_id: str = field(default_factory=default_member_id)
    lease_ttl: float = 5.0
    fetch_batch: int = 500
    commit_every: int = 1000
    commit_interval: float = 1.0
    max_retries: int = 3
    retry_backoff: float = 0.2
    poison: Literal["dead-letter", "block"] = "dead-letter"
    batch_handler: bool = False
    poll_interval: float | None = None
    #: append lease validity windows and assignments as JSON lines here (audits, chaos tests)
    audit_log: str | None = None

    def __post_init__(self) -> None:
        if self.poison not in ("dead-letter", "block"):
            raise ConfigError(
                f"poison policy must be 'dead-letter' or 'block', not {self.poison!r}"
            )
        if self.fetch_batch < 1 or self.commit_every < 1:
            raise ConfigError("fetch_batch and commit_every must be >= 1")
        if self.max_retries < 0:
            raise ConfigError("max_retries must be >= 0")
        if not self.member_id or "." in self.member_id or " " in self.member_id:
            raise ConfigError(f"member id {self.member_id!r} must be non-empty, no dots or spaces")
        GroupConfig(self.stream, self.group, self.lease_ttl)  # validates group and TTL

    @property
    def group_config(self) -> GroupConfig:
        return GroupConfig(self.stream, self.group, self.lease_ttl)

    @property
    def tick(self) -> float:
        return self.poll_interval or min(0.1, self.lease_ttl / 10)


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and wait for ``tasks``; cancel again while any survives (on Python 3.11 an
    ``asyncio.wait_for`` inside nats-py can swallow a cancellation)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


def dead_letter_subject(prefix: str, group: str, partition: int) -> str:
    return f"{prefix}.dlq.{group}.{partition}"


def _sequences(reply: str) -> tuple[int, int]:
    """(stream sequence, consumer sequence) from a JetStream delivery's reply subject, in
    both ACK subject formats."""
    t = reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>            (v1)
    # $JS.ACK.<domain>.<acchash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>...     (v2)
    return (int(t[5]), int(t[6])) if len(t) == 9 else (int(t[7]), int(t[8]))


class _PartitionReader:
    """Reads one partition from a start sequence with an ack-none pull consumer, keeping at
    most two pull requests of ``batch`` messages in flight: pipelined, and bounded (at most
    ``2 * batch`` messages are ever buffered or on the wire for a partition, so lease
    renewals never queue behind megabytes of data on the shared connection).

    With ack-none nothing is re-sent, so nothing may be lost between server and handler:
    every delivery's consumer sequence must follow the previous one. On a gap (a delivery
    lost in a reconnect), a reconnect of the client, an unexpected status, or silence past
    the request expiry, the consumer is re-created at the first sequence not yet handed
    out; anything delivered twice is dropped."""

    EXPIRES = 5.0

    def __init__(self, nc: NATS, stream: str, subject: str, start: int, batch: int) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.stream = stream
        self.subject = subject
        self.next_seq = max(1, start)
        self.batch = batch
        self.sub: Any = None
        self.consumer = ""
        self.inbox = ""
        self._buf: deque[tuple[int, Any]] = deque()
        self._ready = asyncio.Event()
        self._outstanding = 0
        self._last_activity = 0.0
        self._lost = False
        self._cseq = 0  # the last consumer sequence received
        self._reconnects = 0

    async def _on_msg(self, m: Any) -> None:
        self._last_activity = time.monotonic()
        h = m.headers
        status = h.get("Status") if h else None
        if status:
            if status == "408":  # a request expired: its undelivered rest is not coming
                left = h.get("Nats-Pending-Messages")
                self._outstanding -= int(left) if left and left.isdigit() else self.batch
                self._outstanding = max(0, self._outstanding)
            elif status != "100":  # 409 consumer deleted / leadership change, 503, ...
                log.info(
                    "reader of %s: status %s %s; re-creating the consumer",
                    self.subject,
                    status,
                    h.get("Description", ""),
                )
                self._lost = True
            self._ready.set()
            return
        if self._lost or not m.reply:
            return  # the consumer is being re-created from next_seq; or not a delivery
        seq, cseq = _sequences(m.reply)
        if cseq != self._cseq + 1:
            log.warning(
                "reader of %s: delivery %d after %d (lost on the wire); re-reading from seq %d",
                self.subject,
                cseq,
                self._cseq,
                self.next_seq,
            )
            self._lost = True
            self._ready.set()
            return
        self._cseq = cseq
        self._outstanding -= 1
        self._buf.append((seq, m))
        self._ready.set()

    async def _open(self) -> None:
        await self.close()
        info = await self.js.add_consumer(
            self.stream,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self.next_seq,
                ack_policy=api.AckPolicy.NONE,
                filter_subject=self.subject,
                inactive_threshold=30.0,
                mem_storage=True,
                num_replicas=1,
            ),
        )
        self.consumer = info.name or ""
        self.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)
        self._outstanding = 0
        self._lost = False
        self._cseq = 0
        self._reconnects = self.nc.stats["reconnects"]
        self._last_activity = time.monotonic()

    async def _pull(self) -> None:
        req = json.dumps({"batch": self.batch, "expires": int(self.EXPIRES * 1e9)}).encode()
        await self.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}", req, reply=self.inbox
        )
        self._outstanding += self.batch

    async def fetch(self, timeout: float) -> list[tuple[int, Any]]:
        """Up to ``batch`` (stream seq, message) pairs in order; [] after ``timeout``."""
        try:
            silent = time.monotonic() - self._last_activity > self.EXPIRES + 2
            if (
                self.sub is None
                or self._lost
                or (self._outstanding and silent)
                or self.nc.stats["reconnects"] != self._reconnects
            ):
                await self._open()
            while self._outstanding + len(self._buf) <= self.batch:
                await self._pull()
        except (NatsError, NotFoundError, TimeoutError) as exc:
            log.info("reader of %s: %s; retrying at seq %d", self.subject, exc, self.next_seq)
            await self.close()
            await asyncio.sleep(min(timeout, 0.5))
            return []
        if not self._buf:
            self._ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return []
        out = []
        buf = self._buf
        while buf and len(out) < self.batch:
            seq, m = buf.popleft()
            if seq < self.next_seq:
                continue  # re-delivered after the consumer was re-created
            out.append((seq, m))
            self.next_seq = seq + 1
        return out

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
            self.sub = None
        if self.consumer:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, self.consumer)
            self.consumer = ""
        self._buf.clear()
        self._outstanding = 0


class _Owned:
    """A partition this member holds: its lease, grant and task."""

    def __init__(self, partition: int, lease: Lease, grant: Grant) -> None:
        self.partition = partition
        self.lease = lease
        self.grant = grant
        self.task: asyncio.Task[None] | None = None
        self.revoke = asyncio.Event()
        self.processed = 0
        self.blocked: str | None = None
        # renewals and the final commit + release of one lease never interleave
        self.lock = asyncio.Lock()
        self.releasing = False
        self.lost = False
        self.processed_once = False


class Worker:
    """One member of a consumer group. ``await start()`` joins, ``await stop()`` leaves."""

    def __init__(
        self,
        nc: NATS,
        config: WorkerConfig,
        handler: Handler | BatchHandler,
        *,
        on_assign: Callable[[int, int], Any] | None = None,
        on_revoke: Callable[[int], Any] | None = None,
    ) -> None:
        self.nc = nc
        self.cfg = config
        self.handler = handler
        self.on_assign = on_assign
        self.on_revoke = on_revoke
        self.member = config.member_id
        self.store: GroupStore
        self.stream: PartitionedStream
        self.owned: dict[int, _Owned] = {}
        self.generation = 0
        self._is_async = inspect.iscoroutinefunction(handler) or (
            callable(handler) and inspect.iscoroutinefunction(type(handler).__call__)
        )
        self._member_lease: Lease | None = None
        self._leader_lease: Lease | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._closing = False  # the heartbeat loop ends (set once hand-over is done)
        self._crash: asyncio.Task[None] | None = None
        self._started = time.time()
        self._assignment_rev = 0
        self._last_yield = time.monotonic()
        self._mine: set[int] = set()
        self.stopped = asyncio.Event()
        self.stats = {
            "processed": 0,
            "retries": 0,
            "dead_lettered": 0,
            "fenced": 0,
            "leases_lost": 0,
        }

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.stream = await describe(self.nc, self.cfg.stream)
        self.store = await GroupStore.open(self.nc, self.cfg.group_config)
        if self.cfg.poison == "dead-letter":
            await self._ensure_dead_letter_stream()
        self._member_lease = await self.store.heartbeat(self.member, None, self._info())
        for coro in (self._heartbeat_loop(), self._leader_loop(), self._reconcile_loop()):
            self._tasks.append(asyncio.ensure_future(self._guard(coro)))
        log.info(
            "member %s joined group %s of %s (%d partitions, lease TTL %gs)",
            self.member,
            self.cfg.group,
            self.stream.name,
            self.stream.partitions,
            self.cfg.lease_ttl,
        )

    async def stop(self) -> None:
        """Leave gracefully: finish messages in hand, commit, release everything.

        If ``stop()`` itself is cancelled, the member still stops (as a crash would: what
        was not released expires after the TTL) and :attr:`stopped` is set."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        try:
            await self._leave()
        finally:
            self._closing = True
            for t in self._tasks:
                t.cancel()
            for o in list(self.owned.values()):
                if o.task is not None:
                    o.task.cancel()
            self.stopped.set()

    async def _leave(self) -> None:
        # no new claims while handing over: halt the leader and reconcile loops first
        # (the heartbeat keeps renewing the leases being handed over)
        await _cancel_and_wait(self._tasks[1:])
        for o in list(self.owned.values()):
            o.revoke.set()
        await asyncio.gather(
            *(o.task for o in self.owned.values() if o.task), return_exceptions=True
        )
        for o in list(self.owned.values()):  # still in on_assign: nothing was processed
            async with o.lock:  # not while a renewal changes the revision
                o.releasing = True
                with contextlib.suppress(Exception):
                    await self.store.release(o.lease)
            if self.owned.get(o.partition) is o:
                del self.owned[o.partition]
        self._closing = True
        await _cancel_and_wait(self._tasks)
        with contextlib.suppress(Exception):
            if self._leader_lease is not None:
                await self.store.release(self._leader_lease)
            if self._member_lease is not None:
                await self.store.release(self._member_lease)
        log.info("member %s left group %s", self.member, self.cfg.group)

    async def run(self) -> None:
        """Start and run until :meth:`stop` is called (e.g. from a signal handler)."""
        await self.start()
        await self.stopped.wait()

    def _audit(self, **event: Any) -> None:
        if self.cfg.audit_log is None:
            return
        line = json.dumps({"member": self.member, "pid": os.getpid(), **event}) + "\n"
        fd = os.open(self.cfg.audit_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
        finally:
            os.close(fd)

    def _audit_lease(self, p: int, lease: Lease, token: int) -> None:
        """A validity window in wall-clock time: from now (the claim or renewal is confirmed;
        nothing is processed before) to the lease's deadline (its send time + TTL - margin)."""
        now_wall, now_mono = time.time(), time.monotonic()
        until = now_wall + (lease.valid_until - now_mono)
        self._audit(kind="lease", partition=p, token=token, valid_from=now_wall, valid_until=until)

    def _info(self) -> dict[str, Any]:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self._started,
            "partitions": sorted(self.owned),
        }

    async def _guard(self, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("member %s: background loop failed; leaving the group", self.member)
            if self._crash is None:
                self._crash = asyncio.ensure_future(self._crash_stop())

    async def _crash_stop(self) -> None:
        # lose leases without committing (as a crash would): safe, the next owner resumes
        for o in list(self.owned.values()):
            if o.task:
                o.task.cancel()
        await self.stop()

    # -- background loops ------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.cfg.group_config.renew_interval)
            if self.nc.is_closed:
                # the client gave up reconnecting: nothing can be renewed or committed again
                raise ConnectionError("the NATS connection is closed")
            try:
                self._member_lease = await self.store.heartbeat(
                    self.member, self._member_lease, self._info()
                )
            except (TimeoutError, NatsError) as exc:
                log.warning("member %s: heartbeat failed: %s", self.member, exc)
            # all renewals in one round trip (each under its partition's lock): sequential
            # renewals behind a busy event loop could outlast the lease margin
            await asyncio.gather(*(self._renew(o) for o in list(self.owned.values())))
            if self._leader_lease is not None:
                try:
                    await self.store.renew(self._leader_lease)
                except (TimeoutError, LeaseLost, NatsError):
                    self._leader_lease = None

    async def _renew(self, o: _Owned) -> None:
        async with o.lock:
            if o.releasing:
                return  # handing over: its final commit and release own the lease
            try:
                await self.store.renew(o.lease)
                self._audit_lease(o.partition, o.lease, o.grant.token)
            except LeaseLost as exc:
                self._lease_lost(o, exc)
            except (NatsError, TimeoutError) as exc:
                log.warning(
                    "member %s: renewing partition %d failed: %s", self.member, o.partition, exc
                )

    def _lease_lost(self, o: _Owned, exc: LeaseLost) -> None:
        """Stop a partition whose lease is gone, exactly once, whatever stage it is in."""
        if self.owned.get(o.partition) is not o:
            return  # already on its way out
        self.stats["leases_lost"] += 1
        log.warning("member %s: %s; stopping partition %d", self.member, exc, o.partition)
        # the processing loop checks validity before every message: it stops there even if
        # the cancel below were swallowed
        o.lease.valid_until = 0.0
        o.lost = True
        if o.task is None:
            # still in on_assign (e.g. the process was paused there): forget the claim so the
            # partition can be claimed afresh; _try_claim sees this when on_assign returns
            del self.owned[o.partition]
        elif not o.task.done() and not o.task.cancelling():
            # once: a second cancel would interrupt the task's own clean-up
            o.task.cancel()

    async def _live_members(self) -> list[str]:
        js = self.nc.jetstream()
        prefix = f"$KV.{self.cfg.group_config.lease_bucket}.m."
        info = await js.stream_info(
            f"KV_{self.cfg.group_config.lease_bucket}", subjects_filter=f"{prefix}*"
        )
        members = []
        for subject in info.state.subjects or {}:
            key = subject[len("$KV.") + len(self.cfg.group_config.lease_bucket) + 1 :]
            try:
                await self.store.leases.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            members.append(key[2:])
        return sorted(members)

    async def _leader_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick)
            if self._stopping:
                return
            try:
                lease = self._leader_lease  # the heartbeat loop may drop it meanwhile
                if lease is None or not lease.valid:
                    lease = self._leader_lease = await self.store.acquire("leader", self.member)
                    if lease is None:
                        continue
                    log.info("member %s is the leader of group %s", self.member, self.cfg.group)
                members = await self._live_members()
                if not lease.valid:
                    continue
                data, rev = await self.store.read_assignment()
                previous = Assignment.from_json(data) if data else None
                new = assign(self.stream.partitions, members, previous)
                changed = previous is None or new.owners != previous.owners
                if changed and await self.store.write_assignment(new.to_json(), rev) is not None:
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
                log.warning("member %s: leader loop: %s", self.member, exc)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick)
            if self._stopping:
                return
            try:
                data, rev = await self.store.read_assignment()
            except (TimeoutError, NatsError) as exc:
                log.warning("member %s: reading the assignment failed: %s", self.member, exc)
                continue
            if data is not None and rev != self._assignment_rev:
                a = Assignment.from_json(data)
                self._assignment_rev = rev
                self.generation = a.generation
                self._mine = set(a.partitions_of(self.member))
            # release what moved away (cooperative: only these pause)
            for p in [p for p in self.owned if p not in self._mine]:
                self.owned[p].revoke.set()
            # claim what moved here; a previous owner may still be handing it over
            for p in sorted(self._mine - set(self.owned)):
                if self._stopping:
                    return
                try:
                    await self._try_claim(p)
                except (NatsError, TimeoutError, NatsOrderedError) as exc:
                    # a blip (server restart, leader change, a contended token): next tick
                    log.warning("member %s: claiming partition %d failed: %s", self.member, p, exc)

    async def _try_claim(self, p: int) -> None:
        lease = await self.store.acquire(f"p.{p}", self.member)
        if lease is None:
            return
        try:
            grant = await self.store.grant(p, self.member)
        except BaseException:  # including cancellation by stop(): give the lease back
            await asyncio.shield(self.store.release(lease))
            raise
        if not lease.valid:
            # paused between claim and grant: a newer owner may exist, do not fence it off
            # further with on_assign; the partition is claimed afresh next tick
            with contextlib.suppress(NatsError, TimeoutError):
                await self.store.release(lease)
            return
        # registered first, so the heartbeat renews the lease while on_assign runs (a sink
        # may wait on a lock); processing starts only once on_assign has returned
        owned = _Owned(p, lease, grant)
        self.owned[p] = owned
        self._audit_lease(p, lease, grant.token)
        if self.on_assign is not None:
            try:
                r = self.on_assign(p, grant.token)
                if inspect.isawaitable(r):
                    await r
            except Exception:
                # e.g. the sink is unavailable: give the partition back, retry next tick
                log.exception(
                    "member %s: on_assign(%d, %d) failed; releasing the partition",
                    self.member,
                    p,
                    grant.token,
                )
                if self.owned.get(p) is owned:
                    del self.owned[p]
                await self.store.release(lease)
                return
            if self.owned.get(p) is not owned or not lease.valid:
                # the lease lapsed while on_assign ran: someone else may own the partition now
                log.warning(
                    "member %s: lease of partition %d lapsed during on_assign; giving it up",
                    self.member,
                    p,
                )
                if self.owned.get(p) is owned:
                    del self.owned[p]
                with contextlib.suppress(NatsError, TimeoutError):
                    await self.store.release(lease)
                return
        owned.task = asyncio.ensure_future(self._run_partition(owned))
        log.info(
            "member %s owns partition %d (token %d, from seq %d)",
            self.member,
            p,
            grant.token,
            grant.committed + 1,
        )

    # -- processing ----------------------------------------------------------------------------
    async def _run_partition(self, o: _Owned) -> None:
        p, grant = o.partition, o.grant
        subject = partition_subject(self.stream.prefix, p)
        reader = _PartitionReader(
            self.nc, self.stream.name, subject, grant.committed + 1, self.cfg.fetch_batch
        )
        last = grant.committed
        last_commit = time.monotonic()
        since_commit = 0
        graceful = False
        halted = False  # the handler could not finish a message: stop here, commit before it
        try:
            while not o.revoke.is_set() and not halted:
                if not o.lease.valid:
                    raise LeaseLost(f"lease of partition {p} expired locally")
                wait = max(0.05, min(0.5, o.lease.valid_until - time.monotonic()))
                msgs = await reader.fetch(timeout=wait)
                batch: list[Message] = []
                token, batch_mode = grant.token, self.cfg.batch_handler
                for seq, m in msgs:
                    if o.revoke.is_set() and not batch_mode:
                        break
                    if time.monotonic() >= o.lease.valid_until:
                        raise LeaseLost(f"lease of partition {p} expired locally")
                    h = m.headers or {}
                    msg = Message(
                        h.get("Nats-Ordered-Key", ""), m.data, h, p, seq, token, m.subject
                    )
                    if batch_mode:
                        batch.append(msg)
                        continue
                    if not await self._deliver(o, msg, msg):
                        halted = True
                        break
                    last = msg.stream_seq
                    since_commit += 1
                    if self._commit_due(since_commit, last_commit) and await self._commit(
                        grant, last
                    ):
                        since_commit, last_commit = 0, time.monotonic()
                if batch:  # (batch mode only: the loop above never halts in it)
                    if await self._deliver(o, batch, batch[0]):
                        last = batch[-1].stream_seq
                        since_commit += len(batch)
                    else:
                        halted = True
                if self._commit_due(since_commit, last_commit) and await self._commit(grant, last):
                    since_commit, last_commit = 0, time.monotonic()
            graceful = True
        except Fenced as exc:
            self.stats["fenced"] += 1
            log.warning("member %s: %s", self.member, exc)
        except LeaseLost as exc:
            if not o.lost:  # (already counted if the heartbeat found it lost)
                self.stats["leases_lost"] += 1
            log.warning("member %s: %s", self.member, exc)
        except (NatsError, TimeoutError) as exc:
            # e.g. dead-lettering failed during a server blip: hand the partition back with
            # what was done committed; it is claimed again on the next tick
            log.warning("member %s: partition %d stopped by %r", self.member, p, exc)
            graceful = True
        except asyncio.CancelledError:
            pass
        finally:
            stopped_at = time.time()  # processing has stopped: the end of this owner's window
            try:
                await reader.close()
                async with o.lock:
                    o.releasing = True
                    if graceful and o.lease.valid:
                        with contextlib.suppress(Fenced, NatsError, asyncio.TimeoutError):
                            await self.store.commit(grant, last)
                        with contextlib.suppress(NatsError, asyncio.TimeoutError):
                            await self.store.release(o.lease)
            finally:
                # even if the clean-up above is interrupted: a partition left in `owned`
                # without a live task would never be claimed again by this member
                o.releasing = True
                if self.owned.get(p) is o:  # never drop a newer claim of the same partition
                    del self.owned[p]
                self._audit(
                    kind="released",
                    partition=p,
                    token=grant.token,
                    at=stopped_at,
                    graceful=graceful,
                    last=last,
                )
            if self.on_revoke is not None:
                with contextlib.suppress(Exception):
                    r = self.on_revoke(p)
                    if inspect.isawaitable(r):
                        await r
            log.info("member %s released partition %d at seq %d", self.member, p, last)

    def _commit_due(self, since_commit: int, last_commit: float) -> bool:
        return since_commit > 0 and (
            since_commit >= self.cfg.commit_every
            or time.monotonic() - last_commit >= self.cfg.commit_interval
        )

    async def _commit(self, grant: Grant, seq: int) -> bool:
        """Commit; a transient failure (server restart) is retried at the next commit point.
        Fenced propagates: a newer owner exists."""
        try:
            await self.store.commit(grant, seq)
            return True
        except (NatsError, TimeoutError) as exc:
            log.warning(
                "member %s: committing partition %d at %d failed (%s); will retry",
                self.member,
                grant.partition,
                seq,
                exc,
            )
            return False

    async def _call(self, arg: Any) -> None:
        r = self.handler(arg)
        if self._is_async or inspect.isawaitable(r):
            await r
        elif time.monotonic() - self._last_yield > 0.005:
            # a synchronous handler never yields: give the heartbeat and the other partitions
            # a turn at least every 5 ms, or leases would starve and expire
            self._last_yield = time.monotonic()
            await asyncio.sleep(0)

    async def _deliver(self, o: _Owned, arg: Any, first: Message) -> bool:
        """Run the handler with retries; apply the poison policy. False if the partition
        must stop before this message: blocked and then revoked, or revoked while retrying
        (the next owner tries it again)."""
        attempt = 0
        while True:
            try:
                await self._call(arg)
                n = len(arg) if isinstance(arg, list) else 1
                o.processed += n
                self.stats["processed"] += n
                if not o.processed_once:
                    o.processed_once = True
                    # past any message an earlier owner blocked on: clear the marker
                    with contextlib.suppress(NatsError, TimeoutError):
                        await self.store.set_blocked(o.partition, None)
                return True
            except (asyncio.CancelledError, Fenced):
                raise  # a fenced sink told the handler a newer owner exists: stop, no retry
            except Exception as exc:
                if attempt < self.cfg.max_retries:
                    attempt += 1
                    self.stats["retries"] += 1
                    await asyncio.sleep(self.cfg.retry_backoff * 2 ** (attempt - 1))
                    if not o.lease.valid:
                        raise LeaseLost(f"lease of partition {o.partition} expired") from exc
                    if o.revoke.is_set():
                        return False  # moving or stopping: the next owner retries it
                    continue
                reason = f"{type(exc).__name__}: {exc}"
                msgs = arg if isinstance(arg, list) else [arg]
                if self.cfg.poison == "block":
                    o.blocked = (
                        f"blocked at seq {first.stream_seq} after {attempt + 1} attempts: {reason}"
                    )
                    log.error("member %s: partition %d %s", self.member, o.partition, o.blocked)
                    await self.store.set_blocked(o.partition, o.blocked)
                    # keep the lease (nobody may skip the message), stop processing
                    await o.revoke.wait()
                    return False
                if not o.lease.valid:
                    raise LeaseLost(f"lease of partition {o.partition} expired") from exc
                for m in msgs:
                    await self._dead_letter(m, reason)
                return True

    async def _ensure_dead_letter_stream(self) -> None:
        js = self.nc.jetstream()
        name = f"{self.stream.name}_DLQ"
        try:
            await js.stream_info(name)
        except NotFoundError:
            with contextlib.suppress(Exception):  # created concurrently by another member
                await js.add_stream(
                    name=name,
                    subjects=[f"{self.stream.prefix}.dlq.>"],
                    storage=api.StorageType.FILE,
                    num_replicas=self.stream.replicas,
                    duplicate_window=self.stream.duplicate_window or 120,
                )

    async def _dead_letter(self, m: Message, reason: str) -> None:
        headers = dict(m.headers)
        headers[HDR_ERROR] = reason.replace("\r", " ").replace("\n", " ")[:1000]
        headers[HDR_ORIGIN] = json.dumps(
            {
                "stream": self.stream.name,
                "group": self.cfg.group,
                "partition": m.partition,
                "seq": m.stream_seq,
                "token": m.fencing_token,
            }
        )
        if "Nats-Msg-Id" in headers:
            headers["Nats-Msg-Id"] = f"{self.cfg.group}:{headers['Nats-Msg-Id']}"
        await self.nc.jetstream().publish(
            dead_letter_subject(self.stream.prefix, self.cfg.group, m.partition),
            m.data,
            headers=headers,
        )
        self.stats["dead_lettered"] += 1
        log.error(
            "member %s: partition %d seq %d dead-lettered after retries: %s",
            self.member,
            m.partition,
            m.stream_seq,
            reason,
        )


async def run_worker(
    nc: NATS,
    config: WorkerConfig,
    handler: Handler | BatchHandler,
    stop: asyncio.Event,
    **kwargs: Any,
) -> Worker:
    """Run one member until ``stop`` is set, then leave gracefully."""
    w = Worker(nc, config, handler, **kwargs)
    await w.start()
    await stop.wait()
    await w.stop()
    return w
