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
from collections.abc import Awaitable, Callable, Mapping
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
from .continuity import Position, delivering, divergence, stopped_reason
from .errors import (
    BatchFailed,
    ConfigError,
    NatsOrderedError,
    OrderConflict,
    StreamNotFoundError,
)
from .group import (
    Fenced,
    Grant,
    GroupConfig,
    GroupStore,
    Lease,
    LeaseLost,
    MissingCommitPolicy,
    RebalancePolicy,
    StateWentBack,
    StreamRecreated,
    default_member_id,
)
from .partitioning import partition_subject
from .routing_check import route_key
from .streams import PartitionedStream

log = logging.getLogger(__name__)

HDR_ERROR = "Nats-Ordered-Error"
HDR_MSG_ID = "Nats-Msg-Id"
HDR_ORIGIN = "Nats-Ordered-Origin"

#: the longest wait between two attempts of something that keeps failing (a claim whose
#: on_assign or grant fails, a dead-letter publish)
BACKOFF_MAX = 10.0


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler receives.

    ``key`` is the key the record was published with, byte-exact whichever header form
    carried it (:func:`~.keys.message_key`), and it hashes to ``partition`` (records that
    do not are never handed over); ``""`` for a keyless record."""

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
#: ``applied_position(partition) -> (seq, msg_id) | None``, sync or async
AppliedPosition = Callable[[int], Any]


@dataclass(frozen=True)
class WorkerConfig:
    """A member's settings; one home for the CLI, the Airflow adapters and tests."""

    stream: str
    group: str
    member_id: str = field(default_factory=default_member_id)
    lease_ttl: float = 5.0
    fetch_batch: int = 500
    #: bytes of fetched, unhandled messages this member may hold, shared by the partitions
    #: it owns (each gets an equal share; half of a share per pull request's max_bytes)
    max_buffer_bytes: int = 64 * 1024 * 1024
    commit_every: int = 1000
    commit_interval: float = 1.0
    max_retries: int = 3
    retry_backoff: float = 0.2
    poison: Literal["dead-letter", "block"] = "dead-letter"
    batch_handler: bool = False
    poll_interval: float | None = None
    #: how long stop() waits for handlers to finish the message in hand before cancelling
    #: them (as a crash would: nothing committed for them)
    stop_timeout: float = 30.0
    #: append lease validity windows and assignments as JSON lines here (audits, chaos tests)
    audit_log: str | None = None
    #: replicas of the group's KV buckets; None: the stream's replica count
    state_replicas: int | None = None
    #: where a partition whose commit record disappeared resumes: "fail" (refuse it and
    #: report), "earliest" or "latest" (Kafka's auto.offset.reset)
    missing_commit: MissingCommitPolicy = "fail"

    def __post_init__(self) -> None:
        if self.poison not in ("dead-letter", "block"):
            raise ConfigError(
                f"poison policy must be 'dead-letter' or 'block', not {self.poison!r}"
            )
        if self.fetch_batch < 1 or self.commit_every < 1:
            raise ConfigError("fetch_batch and commit_every must be >= 1")
        if self.max_buffer_bytes < 1024:
            raise ConfigError(
                f"max_buffer_bytes must be >= 1024 (bytes), got {self.max_buffer_bytes!r}"
            )
        if self.max_retries < 0:
            raise ConfigError("max_retries must be >= 0")
        if not self.member_id or "." in self.member_id or " " in self.member_id:
            raise ConfigError(f"member id {self.member_id!r} must be non-empty, no dots or spaces")
        _ = self.group_config  # validates group, TTL, replicas and missing_commit

    @property
    def group_config(self) -> GroupConfig:
        return GroupConfig(
            self.stream,
            self.group,
            self.lease_ttl,
            replicas=self.state_replicas,
            missing_commit=self.missing_commit,
        )

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
    most two pull requests in flight: pipelined, and bounded twice. At most ``2 * batch``
    messages, and at most ``budget()`` bytes, are buffered or requested for a partition at
    any time (each request carries ``max_bytes``), so lease renewals never queue behind
    megabytes of data on the shared connection and memory does not grow with message size.
    A single message larger than half the budget is still read: alone, once nothing else
    is buffered or in flight (the server ends a request whose next message does not fit
    with a 409 "Message Size Exceeds MaxBytes" and never sends that message).

    With ack-none nothing is re-sent, so nothing may be lost between server and handler:
    every delivery's consumer sequence must follow the previous one, and the idle
    heartbeats of pending requests name the last consumer sequence the server sent (so a
    lost *last* delivery is noticed within about ``HEARTBEAT`` seconds, not only when a
    later message arrives). On a gap, a reconnect of the client, an unexpected status, or
    silence past the request expiry, the consumer is re-created at the first sequence not
    yet handed out; anything delivered twice is dropped."""

    EXPIRES = 5.0
    HEARTBEAT = 1.0  # the server requires EXPIRES >= 2 * HEARTBEAT

    def __init__(
        self,
        nc: NATS,
        stream: str,
        subject: str,
        start: int,
        batch: int,
        budget: Callable[[], int],
        verify: Callable[[int, str | None], Awaitable[Any]] | None = None,
        start_id: str | None = None,
    ) -> None:
        #: awaited with (the last sequence handed out, its Nats-Msg-Id) before the consumer
        #: is re-created (never before the first): raises if that position is no longer
        #: part of the stream (a re-created stream, or stored state that went back)
        self.verify = verify
        self._opened = False
        self.nc = nc
        self.js = nc.jetstream()
        self.stream = stream
        self.subject = subject
        self.next_seq = max(1, start)
        #: the Nats-Msg-Id of the message at next_seq - 1 (None if unknown)
        self.last_id = start_id
        self.batch = batch
        self.budget = budget
        self.sub: Any = None
        self.consumer = ""
        self.inbox = ""
        self._buf: deque[tuple[int, Any, int]] = deque()  # (stream seq, message, size)
        self._buf_bytes = 0
        # pull requests in flight, oldest first (the server serves them in order):
        # [messages still due, bytes still allowed, messages received]
        self._requests: deque[list[int]] = deque()
        self._oversize = False  # the next message alone exceeds a request's max_bytes
        self._ready = asyncio.Event()
        self._last_activity = 0.0
        self._lost = False
        self._cseq = 0  # the last consumer sequence received
        self._reconnects = 0

    @staticmethod
    def _size(m: Any) -> int:
        """A delivery's size as the server counts it against ``max_bytes`` (approximately:
        subject, reply subject, headers and data)."""
        hdr = sum(len(k) + len(v) + 4 for k, v in m.headers.items()) + 12 if m.headers else 0
        return len(m.subject) + len(m.reply) + hdr + len(m.data)

    def _end_request(self, status: str) -> None:
        """The oldest request ended early (expired, or its next message did not fit)."""
        if not self._requests:
            return
        req = self._requests.popleft()
        if status == "409" and req[2] == 0:
            self._oversize = True  # not even the first message fitted: read it alone

    async def _on_msg(self, m: Any) -> None:
        self._last_activity = time.monotonic()
        h = m.headers
        status = h.get("Status") if h else None
        if status:
            desc = h.get("Description", "")
            if status == "100":
                last = h.get("Nats-Last-Consumer", "")
                if last.isdigit() and int(last) > self._cseq and not self._lost:
                    log.warning(
                        "reader of %s: deliveries %d..%s lost on the wire; re-reading from seq %d",
                        self.subject,
                        self._cseq + 1,
                        last,
                        self.next_seq,
                    )
                    self._lost = True
            elif status == "408" or (status == "409" and desc == "Message Size Exceeds MaxBytes"):
                self._end_request(status)
            elif status == "409" and desc == "Batch Completed":
                pass  # sent after the last message of a request that asked for heartbeats
            else:  # 409 consumer deleted / leadership change, 503, ...
                log.info(
                    "reader of %s: status %s %s; re-creating the consumer",
                    self.subject,
                    status,
                    desc,
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
        size = self._size(m)
        if self._requests:
            req = self._requests[0]
            req[0] -= 1
            req[1] -= size
            req[2] += 1
            if req[0] <= 0:
                self._requests.popleft()
        self._buf.append((seq, m, size))
        self._buf_bytes += size
        self._ready.set()

    async def _open(self) -> None:
        await self.close()
        if self._opened and self.verify is not None:
            # a consumer lost with its stream (or with the servers' stored state) must not
            # resume on a stream that hands out the sequences after next_seq again
            await self.verify(self.next_seq - 1, self.last_id)
        self._opened = True
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
        self._lost = False
        self._oversize = False
        self._cseq = 0
        self._reconnects = self.nc.stats["reconnects"]
        self._last_activity = time.monotonic()

    async def _pull(self, batch: int, max_bytes: int | None) -> None:
        req: dict[str, int] = {
            "batch": batch,
            "expires": int(self.EXPIRES * 1e9),
            "idle_heartbeat": int(self.HEARTBEAT * 1e9),
        }
        if max_bytes is not None:
            req["max_bytes"] = max_bytes
        await self.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}",
            json.dumps(req).encode(),
            reply=self.inbox,
        )
        self._requests.append([batch, max_bytes if max_bytes is not None else 1 << 62, 0])

    async def _pull_what_fits(self) -> None:
        """Top up to two requests in flight within the count and byte bounds."""
        if self._oversize:
            if not self._requests and not self._buf:
                self._oversize = False
                await self._pull(1, None)  # one message, whatever its size
            return
        budget = self.budget()
        while len(self._requests) < 2:
            due = sum(r[0] for r in self._requests)
            allowed = sum(max(0, r[1]) for r in self._requests)
            room = min(budget // 2, budget - self._buf_bytes - allowed)
            if due + len(self._buf) > self.batch or room < budget // 4:
                return
            await self._pull(self.batch, max(1, room))

    async def fetch(self, timeout: float) -> list[tuple[int, Any]]:
        """Up to ``batch`` (stream seq, message) pairs in order; [] after ``timeout``.
        What a previous call returned counts as released (handled) from now on."""
        try:
            silent = time.monotonic() - self._last_activity > self.EXPIRES + 2
            if (
                self.sub is None
                or self._lost
                or (self._requests and silent)
                or self.nc.stats["reconnects"] != self._reconnects
            ):
                await self._open()
            await self._pull_what_fits()
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
            seq, m, size = buf.popleft()
            self._buf_bytes -= size
            if seq < self.next_seq:
                continue  # re-delivered after the consumer was re-created
            out.append((seq, m))
            self.next_seq = seq + 1
        if out:
            self.last_id = (out[-1][1].headers or {}).get(HDR_MSG_ID)
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
        self._buf_bytes = 0
        self._requests.clear()


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
        self.finishing = False  # the partition task is in its clean-up (commit, release, revoke)
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
        fencing_floor: Callable[[int], int | Awaitable[int]] | None = None,
        applied_position: AppliedPosition | None = None,
    ) -> None:
        self.nc = nc
        self.cfg = config
        self.handler = handler
        self.on_assign = on_assign
        self.on_revoke = on_revoke
        self.fencing_floor = fencing_floor
        #: the sink's last applied (seq, msg id) of a partition: checked against the stream
        #: at every grant (a handler object's own ``applied_position`` if not given)
        self.applied_position = applied_position or getattr(handler, "applied_position", None)
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
        #: the last processing task of each partition: it is claimed again only once that
        #: task (and its on_revoke) has finished
        self._previous: dict[int, asyncio.Task[None]] = {}
        #: partition -> (monotonic time before which it is not claimed, last delay)
        self._claim_backoff: dict[int, tuple[float, float]] = {}
        #: what keeps failing, by topic; published in the heartbeat (``status`` shows it)
        self.problems: dict[str, str] = {}
        self._assigned = asyncio.Event()
        self.stopped = asyncio.Event()
        self.stats = {
            "processed": 0,
            "handler_errors": 0,
            "retries": 0,
            "dead_lettered": 0,
            "fenced": 0,
            "leases_lost": 0,
            "rebalances": 0,
            #: records never handed to the handler: misrouted, keyless on a keyed stream,
            #: malformed key (each also dead-lettered or blocked on)
            "rejected": 0,
            #: partitions stopped for an operator: a position no longer in the stream's
            #: history (its stored state went back), a message the sink can neither apply
            #: nor skip
            "stopped": 0,
        }
        #: seconds the last round of renewals took (member heartbeat + every lease)
        self.renew_seconds = 0.0
        #: monotonic time of the last member heartbeat the server accepted (0: none yet)
        self.last_heartbeat = 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.store = await GroupStore.open(self.nc, self.cfg.group_config)
        assert self.store.stream is not None  # (open() describes the stream)
        self.stream = self.store.stream
        if self.cfg.poison == "dead-letter":
            try:
                await self._ensure_dead_letter_stream()
            except NatsOrderedError as exc:  # retried (with backoff) when a message needs it
                log.warning("member %s: %s", self.member, exc)
                self._report("dead-letter", str(exc))
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
        tasks = [o.task for o in self.owned.values() if o.task]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.cfg.stop_timeout)
            if late:
                # a handler stuck in I/O: stop it as a crash would (nothing committed for it;
                # its leases are released below or expire)
                log.warning(
                    "member %s: %d partition(s) did not finish within stop_timeout %gs; "
                    "cancelling them",
                    self.member,
                    len(late),
                    self.cfg.stop_timeout,
                )
                await _cancel_and_wait(list(late))
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

    @property
    def claimed(self) -> set[int]:
        """The partitions this member is processing (claimed, ``on_assign`` returned)."""
        return {p for p, o in self.owned.items() if o.task is not None}

    @property
    def assigned(self) -> set[int]:
        """The partitions the latest assignment this member read gives it."""
        return set(self._mine)

    async def wait_assigned(self, timeout: float | None = None) -> None:
        """Return once this member has its first assignment and has claimed every
        partition in it: lease held, token granted, ``on_assign`` returned, processing
        started. Raises TimeoutError after ``timeout`` seconds (a member that the assignment
        gives no partition, with more members than partitions, waits until then), and
        NatsOrderedError if the member stops first."""
        waits = [
            asyncio.ensure_future(self._assigned.wait()),
            asyncio.ensure_future(self.stopped.wait()),
        ]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise TimeoutError(
                f"member {self.member} has not claimed its assignment after {timeout:g}s "
                f"(assigned {sorted(self._mine)}, claimed {sorted(self.owned)}; "
                f"problems: {sorted(self.problems.values()) or 'none'})"
            ) from None
        finally:
            for w in waits:
                w.cancel()
        if not self._assigned.is_set():
            raise NatsOrderedError(f"member {self.member} stopped before it was assigned")

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
            "problems": sorted(self.problems.values()),
        }

    def _report(self, topic: str, problem: str | None) -> None:
        """Set (or with None clear) the problem of ``topic``; the next heartbeat publishes
        the list under ``problems``, and ``status`` shows it."""
        if problem is None:
            self.problems.pop(topic, None)
        elif self.problems.get(topic) != problem:
            self.problems[topic] = problem

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
            started = time.monotonic()
            try:
                self._member_lease = await self.store.heartbeat(
                    self.member, self._member_lease, self._info()
                )
                self.last_heartbeat = time.monotonic()
            except (TimeoutError, NatsError) as exc:
                log.warning("member %s: heartbeat failed: %s", self.member, exc)
            # all renewals in one round trip (each under its partition's lock): sequential
            # renewals behind a busy event loop could outlast the lease margin
            await asyncio.gather(*(self._renew(o) for o in list(self.owned.values())))
            self.renew_seconds = time.monotonic() - started
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
        elif not o.task.done() and not o.task.cancelling() and not o.finishing:
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
                log.warning("member %s: leader loop: %s", self.member, exc)

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
                mine = set(a.partitions_of(self.member))
                if mine != self._mine:
                    self.stats["rebalances"] += 1
                self._mine = mine
            # release what moved away (cooperative: only these pause)
            for p in [p for p in self.owned if p not in self._mine]:
                self.owned[p].revoke.set()
            # claim what moved here; a previous owner may still be handing it over
            for p in sorted(self._mine - set(self.owned)):
                if self._stopping:
                    return
                previous = self._previous.get(p)
                if previous is not None and not previous.done():
                    continue  # on_assign(p) never runs before this member's on_revoke(p) ended
                if time.monotonic() < self._claim_backoff.get(p, (0.0, 0.0))[0]:
                    continue
                try:
                    await self._try_claim(p)
                except (NatsError, TimeoutError) as exc:
                    # a blip (server restart, leader change): next tick
                    log.warning("member %s: claiming partition %d failed: %s", self.member, p, exc)
                except NatsOrderedError as exc:
                    # not a blip (a contended token, a missing commit record, a re-created
                    # stream): retry later and later, and say so in the status
                    log.warning("member %s: claiming partition %d failed: %s", self.member, p, exc)
                    self._back_off(p, f"claiming failed: {exc}")
            if self._mine and self._mine <= self.claimed:
                self._assigned.set()

    async def _floor(self, p: int) -> int:
        """The highest fencing token the handler's sink has seen for ``p`` (0 if unknown)."""
        if self.fencing_floor is None:
            return 0
        try:
            r = self.fencing_floor(p)
            return int(await r if inspect.isawaitable(r) else r)
        except Exception as exc:  # e.g. the sink is unavailable: back off like on_assign
            raise NatsOrderedError(
                f"fencing_floor({p}) failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _back_off(self, p: int, problem: str) -> None:
        """Claim ``p`` again only after a delay that doubles with each failure, up to
        ``BACKOFF_MAX``; report ``problem`` until a claim succeeds."""
        delay = self._claim_backoff.get(p, (0.0, 0.0))[1] * 2
        delay = min(BACKOFF_MAX, max(self.cfg.tick, self.cfg.retry_backoff, delay))
        self._claim_backoff[p] = (time.monotonic() + delay, delay)
        self._report(f"claim.{p}", f"partition {p}: {problem}; retrying in {delay:.1f}s")

    async def _try_claim(self, p: int) -> None:
        lease = await self.store.acquire(f"p.{p}", self.member)
        if lease is None:
            return
        try:
            grant = await self.store.grant(p, self.member, floor=await self._floor(p))
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
            except Exception as exc:
                # e.g. the sink is unavailable: give the partition back, retry with backoff
                log.exception(
                    "member %s: on_assign(%d, %d) failed; releasing the partition",
                    self.member,
                    p,
                    grant.token,
                )
                if self.owned.get(p) is owned:
                    del self.owned[p]
                self._back_off(p, f"on_assign failed: {type(exc).__name__}: {exc}")
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
        owned.task = self._previous[p] = asyncio.ensure_future(self._run_partition(owned))
        self._claim_backoff.pop(p, None)
        self._report(f"claim.{p}", None)
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
            self.nc,
            self.stream.name,
            subject,
            grant.committed + 1,
            self.cfg.fetch_batch,
            self._buffer_share,
            lambda seq, msg_id: self._verify_position(p, seq, msg_id),
            grant.committed_id or None,
        )
        last, last_id = grant.committed, grant.committed_id or None
        last_commit = time.monotonic()
        since_commit = 0
        graceful = False
        given_up = False  # fenced or lease lost: stop without committing, free what is held
        halted = False  # the handler could not finish a message: stop here, commit before it
        #: why the partition must stop and wait for an operator (positions that are not in
        #: the stream's history any more, a message the sink can neither apply nor skip)
        stopped: str | None = None
        try:
            stopped = await self._continuity(o)
            while stopped is None and not o.revoke.is_set() and not halted:
                if not o.lease.valid:
                    raise LeaseLost(f"lease of partition {p} expired locally")
                wait = max(0.05, min(0.5, o.lease.valid_until - time.monotonic()))
                try:
                    fetched = await reader.fetch(timeout=wait)
                except StateWentBack as exc:
                    stopped = self._went_back(p, str(exc), None, exc.last_seq)
                    break
                msgs, rejected = self._messages(o, fetched)
                step = max(1, len(msgs)) if self.cfg.batch_handler else 1
                for i in range(0, len(msgs), step):
                    if o.revoke.is_set():
                        break
                    if time.monotonic() >= o.lease.valid_until:
                        raise LeaseLost(f"lease of partition {p} expired locally")
                    chunk = msgs[i : i + step]
                    try:
                        done = await self._deliver(o, chunk, rejected)
                    except OrderConflict as exc:
                        stopped = self._refused(chunk[0], exc)
                        break
                    if done:
                        last = chunk[done - 1].stream_seq
                        last_id = chunk[done - 1].headers.get(HDR_MSG_ID)
                        since_commit += done
                    if done < len(chunk):
                        halted = True
                        break
                    if self._commit_due(since_commit, last_commit) and await self._commit(
                        grant, last, last_id
                    ):
                        since_commit, last_commit = 0, time.monotonic()
                # handled: let go of them before fetching more (the byte bound counts on it)
                msgs = chunk = []
                if stopped is None and (
                    self._commit_due(since_commit, last_commit)
                    and await self._commit(grant, last, last_id)
                ):
                    since_commit, last_commit = 0, time.monotonic()
            if stopped is not None:
                # no commit: what was handled since the last one may be past the stream's end
                given_up = True
                await self._hold(o, stopped)
            else:
                graceful = True
        except Fenced as exc:
            self.stats["fenced"] += 1
            given_up = True
            log.warning("member %s: %s", self.member, exc)
        except (StreamRecreated, StreamNotFoundError) as exc:
            # positions refer to the old (or a deleted) stream: stop without committing;
            # claims back off and report it until an operator resets the group
            given_up = True
            self._report("stream", str(exc))
            log.error("member %s: partition %d: %s", self.member, p, exc)
        except LeaseLost as exc:
            if not o.lost:  # (already counted if the heartbeat found it lost)
                self.stats["leases_lost"] += 1
            given_up = True
            log.warning("member %s: %s", self.member, exc)
        except NatsOrderedError as exc:
            # the handler's applied_position hook failed (its sink is unavailable): give the
            # partition back and claim it again later, as when on_assign fails
            given_up = True
            log.warning("member %s: partition %d: %s", self.member, p, exc)
            self._back_off(p, str(exc))
        except (NatsError, TimeoutError) as exc:
            # e.g. dead-lettering failed during a server blip: hand the partition back with
            # what was done committed; it is claimed again on the next tick
            log.warning("member %s: partition %d stopped by %r", self.member, p, exc)
            graceful = True
        except asyncio.CancelledError:
            pass
        finally:
            o.finishing = True  # from here on a lost lease must not cancel the clean-up
            stopped_at = time.time()  # processing has stopped: the end of this owner's window
            try:
                await reader.close()
                async with o.lock:
                    o.releasing = True
                    if graceful and o.lease.valid:
                        with contextlib.suppress(Fenced, NatsError, asyncio.TimeoutError):
                            await self.store.commit(grant, last, last_id)
                        with contextlib.suppress(NatsError, asyncio.TimeoutError):
                            await self.store.release(o.lease)
                    elif given_up:
                        # no commit (a newer owner may exist), but a lease key still at our
                        # revision is ours: delete it (compare-and-set, so never a newer
                        # owner's) so the partition moves at once rather than after a TTL
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

    async def _sink_position(self, p: int) -> tuple[int, str | None] | None:
        """The sink's applied position of ``p`` from the handler's ``applied_position``
        hook (None without a hook, or if the sink applied nothing)."""
        if self.applied_position is None:
            return None
        try:
            r = self.applied_position(p)
            r = await r if inspect.isawaitable(r) else r
            if r is None:
                return None
            seq, msg_id = r
            return int(seq), (str(msg_id) if msg_id else None)
        except Exception as exc:
            raise NatsOrderedError(
                f"applied_position({p}) failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def _continuity(self, o: _Owned) -> str | None:
        """Check, before anything of a newly granted partition is handled, that the group's
        committed position and the sink's applied position are still part of the stream's
        history. The blocked reason (with the operator action) if not, else None."""
        p, grant = o.partition, o.grant
        subject = self.stream.subject(p)
        positions = [
            Position(
                grant.committed, grant.committed_id or None, f"the group's commit record c.{p}"
            )
        ]
        sink = await self._sink_position(p)
        if sink is not None:
            positions.append(Position(sink[0], sink[1], "the sink's applied position"))
        problems: list[str] = []
        anchor: int | None = None
        last_seq = 0
        for pos in positions:
            found = await self.store.stored_at(pos.seq)
            last_seq = found.last_seq
            why = divergence(pos, subject, found)
            if why is not None:
                problems.append(why)
            elif pos is positions[0]:
                anchor = pos.seq
        if not problems:
            self._report(f"continuity.{p}", None)
            return None
        return self._went_back(p, "; ".join(problems), anchor, last_seq)

    def _went_back(self, p: int, problem: str, anchor: int | None, last_seq: int) -> str:
        return stopped_reason(self.stream.name, self.cfg.group, p, problem, anchor, last_seq)

    async def _verify_position(self, p: int, seq: int, msg_id: str | None) -> None:
        """Before the reader of ``p`` re-creates its consumer: the stream is the one the
        group's positions refer to, and still holds the last message handed out."""
        await self.store.check_stream()
        found = await self.store.stored_at(seq)
        why = divergence(
            Position(seq, msg_id, "the reader's position"), self.stream.subject(p), found
        )
        if why is not None:
            raise StateWentBack(why, found.last_seq)

    def _refused(self, m: Message, exc: OrderConflict) -> str:
        return (
            f"stopped at seq {m.stream_seq}: the handler's sink can neither apply nor skip it "
            f"({type(exc).__name__}: {exc}), so it is not retried or dead-lettered. If the "
            "stream's stored state went back, the operator action is to rewind the sink and "
            "reset the group to the last sequence both still agree on"
        )

    async def _hold(self, o: _Owned, reason: str) -> None:
        """Stop handling ``o`` and say why (blocked marker, problems) until it is revoked
        (e.g. by an operator's reset, which takes the lease): the lease is kept, so no other
        member resumes it meanwhile, and nothing is committed."""
        p = o.partition
        o.blocked = reason
        self.stats["stopped"] += 1
        log.error("member %s: partition %d %s", self.member, p, reason)
        self._report(f"continuity.{p}", f"partition {p}: {reason}")
        written = False
        while not o.revoke.is_set():
            if not written:
                with contextlib.suppress(NatsError, TimeoutError):
                    await self.store.set_blocked(p, reason)
                    written = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await o.revoke.wait()

    def _messages(
        self, o: _Owned, fetched: list[tuple[int, Any]]
    ) -> tuple[list[Message], dict[int, str]]:
        """The handler's view of fetched deliveries, and why those that must not reach it
        are rejected (by stream sequence): a key that does not hash to this partition, a
        missing key where the stream requires one, an undecodable key header."""
        p, token, partitions = o.partition, o.grant.token, self.stream.partitions
        keys_required = bool(getattr(self.stream, "keys_required", False))
        msgs: list[Message] = []
        rejected: dict[int, str] = {}
        for seq, m in fetched:
            headers = m.headers or {}
            key, why = route_key(headers, p, partitions, keys_required=keys_required)
            if why is not None:
                rejected[seq] = why
            msgs.append(Message(key or "", m.data, headers, p, seq, token, m.subject))
        return msgs, rejected

    def _buffer_share(self) -> int:
        """One partition's share of ``max_buffer_bytes``."""
        return self.cfg.max_buffer_bytes // max(1, len(self.owned))

    def _commit_due(self, since_commit: int, last_commit: float) -> bool:
        return since_commit > 0 and (
            since_commit >= self.cfg.commit_every
            or time.monotonic() - last_commit >= self.cfg.commit_interval
        )

    async def _commit(self, grant: Grant, seq: int, msg_id: str | None) -> bool:
        """Commit; a transient failure (server restart) is retried at the next commit point.
        Fenced propagates: a newer owner exists."""
        try:
            await self.store.commit(grant, seq, msg_id)
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
        # the msg-ids of what is handed over, for a sink the handler gives no msg_id
        batch = arg if isinstance(arg, list) else [arg]
        ids = {(m.partition, m.stream_seq): i for m in batch if (i := m.headers.get(HDR_MSG_ID))}
        token = delivering.set(ids)
        try:
            r = self.handler(arg)
            if self._is_async or inspect.isawaitable(r):
                await r
        finally:
            delivering.reset(token)
        if not self._is_async and time.monotonic() - self._last_yield > 0.005:
            # a synchronous handler never yields: give the heartbeat and the other partitions
            # a turn at least every 5 ms, or leases would starve and expire
            self._last_yield = time.monotonic()
            await asyncio.sleep(0)

    async def _deliver(
        self, o: _Owned, msgs: list[Message], rejected: Mapping[int, str] | None = None
    ) -> int:
        """Hand ``msgs`` (one message, or one batch in batch mode) to the handler, with
        retries and the poison policy. Returns how many of ``msgs``, from the first, are
        done (applied, or dead-lettered); fewer than all when the partition must stop
        before the next one: blocked and then revoked, or revoked while retrying (the next
        owner tries it again).

        A message in ``rejected`` (its stream sequence -> why: misrouted, keyless on a
        keyed stream, malformed key) is never handed to the handler: it goes straight to
        the poison policy, and a batch is cut before it.

        A batch handler reports partial progress by raising :class:`BatchFailed`
        (``applied=n``): retries resume at message n, and only a message that keeps failing
        is dead-lettered. Any other exception means nothing of the batch was applied; once
        its retries are spent, the batch's messages are retried one at a time, so only the
        ones that fail on their own are dead-lettered."""
        rejected = rejected or {}
        batch_mode = self.cfg.batch_handler
        one_by_one = not batch_mode
        done = attempt = 0
        while done < len(msgs):
            why = rejected.get(msgs[done].stream_seq)
            if why is not None:
                self.stats["rejected"] += 1
                if not await self._poison(
                    o, msgs[done], f"{why} (not handed to the handler)", None
                ):
                    return done
                done, attempt = done + 1, 0
                continue
            end = next(
                (i for i in range(done + 1, len(msgs)) if msgs[i].stream_seq in rejected),
                len(msgs),
            )
            chunk = msgs[done : done + 1] if one_by_one else msgs[done:end]
            try:
                await self._call(chunk if batch_mode else chunk[0])
                applied, error = len(chunk), None
            except (asyncio.CancelledError, Fenced, OrderConflict):
                # a fenced sink told the handler a newer owner exists, or it can neither
                # apply nor skip the message: stop, no retry, no dead letter
                raise
            except BatchFailed as exc:
                applied, error = (min(exc.applied, len(chunk) - 1) if batch_mode else 0), exc
            except Exception as exc:
                applied, error = 0, exc
            if applied:
                o.processed += applied
                self.stats["processed"] += applied
                if not o.processed_once:
                    await self._first_applied(o)
                done, attempt = done + applied, 0
            if error is None:
                continue
            self.stats["handler_errors"] += 1
            if attempt < self.cfg.max_retries:
                attempt += 1
                self.stats["retries"] += 1
                await asyncio.sleep(self.cfg.retry_backoff * 2 ** (attempt - 1))
                if not o.lease.valid:
                    raise LeaseLost(f"lease of partition {o.partition} expired") from error
                if o.revoke.is_set():
                    return done  # moving or stopping: the next owner retries it
                continue
            if len(chunk) - applied > 1 and not isinstance(error, BatchFailed):
                # an all-or-nothing batch keeps failing: find the culprit(s) one by one
                one_by_one, attempt = True, 0
                continue
            if not await self._poison(
                o, msgs[done], f"{type(error).__name__}: {error}", attempt + 1, error
            ):
                return done
            done, attempt = done + 1, 0
        return done

    async def _poison(
        self,
        o: _Owned,
        m: Message,
        reason: str,
        attempts: int | None,
        error: BaseException | None = None,
    ) -> bool:
        """Apply the poison policy to ``m`` (failed ``attempts`` times, or None: rejected
        without a handler call). True once it is dead-lettered (processing moves on); False
        if the partition must stop before it: blocked (the lease is kept, nobody may skip
        it, until the partition is revoked), or revoked while dead-lettering."""
        if self.cfg.poison == "block":
            tried = f" after {attempts} attempts" if attempts is not None else ""
            o.blocked = f"blocked at seq {m.stream_seq}{tried}: {reason}"
            log.error("member %s: partition %d %s", self.member, o.partition, o.blocked)
            await self.store.set_blocked(o.partition, o.blocked)
            # keep the lease (nobody may skip the message), stop processing
            await o.revoke.wait()
            return False
        if not o.lease.valid:
            raise LeaseLost(f"lease of partition {o.partition} expired") from error
        return await self._dead_letter(o, m, reason)

    async def _first_applied(self, o: _Owned) -> None:
        o.processed_once = True
        # past any message an earlier owner blocked on: clear the marker
        with contextlib.suppress(NatsError, TimeoutError):
            await self.store.set_blocked(o.partition, None)

    async def _ensure_dead_letter_stream(self) -> None:
        """Create ``<STREAM>_DLQ`` unless it exists; NatsOrderedError saying why if it cannot
        be created."""
        js = self.nc.jetstream()
        name = f"{self.stream.name}_DLQ"
        subjects = f"{self.stream.prefix}.dlq.>"
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            pass
        try:
            await js.add_stream(
                name=name,
                subjects=[subjects],
                storage=api.StorageType.FILE,
                num_replicas=self.stream.replicas,
                duplicate_window=self.stream.duplicate_window or 120,
            )
        except NatsError as exc:
            with contextlib.suppress(NotFoundError):
                await js.stream_info(name)
                return  # created concurrently by another member
            raise NatsOrderedError(
                f"the dead-letter stream {name} could not be created ({exc}); create it with "
                f"subjects {subjects!r}, or use poison='block'"
            ) from exc

    async def _dead_letter(self, o: _Owned, m: Message, reason: str) -> bool:
        """Publish ``m`` to its dead-letter subject, retrying with capped exponential
        backoff while the partition is held (its lease renewed, nothing after ``m``
        processed) and reporting the failure in :attr:`problems`. False if the partition
        was revoked meanwhile (the next owner handles ``m`` again)."""
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
        subject = dead_letter_subject(self.stream.prefix, self.cfg.group, m.partition)
        key = f"dead-letter.{m.partition}"
        delay = 0.0
        while True:
            try:
                await self.nc.jetstream().publish(subject, m.data, headers=headers)
                break
            except (NatsError, TimeoutError) as exc:
                cause: Exception = exc
                with contextlib.suppress(NatsError, TimeoutError):
                    try:
                        await self._ensure_dead_letter_stream()  # deleted meanwhile?
                    except NatsOrderedError as why:
                        cause = why
            delay = min(BACKOFF_MAX, max(self.cfg.tick, self.cfg.retry_backoff, delay * 2))
            self._report(
                key,
                f"partition {m.partition}: dead-lettering seq {m.stream_seq} failed: {cause}; "
                f"retrying in {delay:.1f}s",
            )
            await asyncio.sleep(delay)
            if not o.lease.valid:
                raise LeaseLost(f"lease of partition {o.partition} expired")
            if o.revoke.is_set():
                return False
        self._report(key, None)
        self._report("dead-letter", None)
        self.stats["dead_lettered"] += 1
        log.error(
            "member %s: partition %d seq %d dead-lettered after retries: %s",
            self.member,
            m.partition,
            m.stream_seq,
            reason,
        )
        return True


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
