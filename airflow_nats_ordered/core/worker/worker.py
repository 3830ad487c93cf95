"""The worker (:class:`Worker`): a group member; here its membership, and :func:`run_worker`.

Membership: joining and leaving (:meth:`Worker.start`, :meth:`Worker.stop`), the heartbeat
renewing the member's and every partition's lease, the leader computing the assignment,
the reconcile loop claiming and revoking partitions. The rest lives in the module named
after it, and every name stays importable from this one:

* :mod:`..stream.message` - :class:`Message` (what a handler receives) and the handler types
* :mod:`.config` - :class:`WorkerConfig`, ``BACKOFF_MAX``
* :mod:`.owned` - :class:`OwnedPartition` (a partition this member holds)
* :mod:`..stream.reader` - :class:`PartitionReader`: one partition, in order, bounded buffers
* :mod:`.delivery` - :class:`PartitionDelivery`, mixed into :class:`Worker`: a partition's
  messages to the handler (retries, poison policy, batches, commits, continuity checks)
* :mod:`.handler_calls` - :class:`HandlerCalls` (a mixin): calling the handler
* :mod:`.dead_letters` - :func:`dead_letter_subject`, :class:`DeadLettering` (a mixin)
* :mod:`.presence` - :class:`GroupWatch` (a mixin): the group deleted under the member
* :mod:`.leader` - :class:`GroupLeader` (a mixin): the leader's loop computing the assignment
* :mod:`.lease_claims` - :func:`claim_lease`: a partition's lease, never left held by stop()

Guarantees (each tested by breaking it in ``tests/core/worker/test_worker_chaos.py``; processing's
in
:mod:`.delivery`)
------------------------------------------------------------------------
* **Exclusive ownership.** A partition is processed only while its lease is valid, with
  validity measured from when the claim or renewal was *sent* (minus a safety margin), so
  a member stops before the server could grant the lease to anyone else.
* **Fencing.** Each grant bumps the partition's token by compare-and-set in the commit
  record; every message handed to the handler carries it (``Message.fencing_token``), and a
  previous owner's commits fail once a newer grant exists.
* **Cooperative, sticky rebalancing.** One member (the leader, itself a lease) computes the
  assignment with the sticky assignor; the others reconcile: only partitions that move are
  stopped (committed and released at once) and claimed by their new owner.
* **Graceful stop.** :meth:`Worker.stop` finishes the message in hand, commits, releases
  every lease and leaves the group, so hand-over does not wait for a TTL.
* **A deleted group stops the member, once.** When its group's buckets are deleted (or
  deleted and created again) under it, the member logs one error, stops as on a crash and
  sets :attr:`Worker.error` to a :class:`GroupDeletedError`; it never retries against, or
  re-creates, a group an operator deleted.
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
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.assignor import Assignment
from airflow_nats_ordered.core.group.store import GroupStore, Lease, LeaseLost
from airflow_nats_ordered.core.stream.layout import state_key
from airflow_nats_ordered.core.stream.message import (
    HDR_MSG_ID,
    AppliedPosition,
    BatchHandler,
    Handler,
    Message,
)
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.stream.reader import PartitionReader
from airflow_nats_ordered.core.worker.config import BACKOFF_MAX, WorkerConfig
from airflow_nats_ordered.core.worker.dead_letters import (
    HDR_ERROR,
    HDR_ORIGIN,
    DeadLettering,
    dead_letter_subject,
)
from airflow_nats_ordered.core.worker.delivery import PartitionDelivery
from airflow_nats_ordered.core.worker.epochs import EpochSwitch, read_group_epoch
from airflow_nats_ordered.core.worker.leader import GroupLeader
from airflow_nats_ordered.core.worker.lease_claims import claim_lease
from airflow_nats_ordered.core.worker.owned import OwnedPartition
from airflow_nats_ordered.core.worker.presence import GroupDeletedError, GroupPresence, GroupWatch

__all__ = [
    "BACKOFF_MAX",
    "HDR_ERROR",
    "HDR_MSG_ID",
    "HDR_ORIGIN",
    "AppliedPosition",
    "BatchHandler",
    "DeadLettering",
    "GroupDeletedError",
    "Handler",
    "Message",
    "OwnedPartition",
    "PartitionDelivery",
    "PartitionReader",
    "Worker",
    "WorkerConfig",
    "dead_letter_subject",
    "run_worker",
]

log = logging.getLogger(__name__)

#: how many times a member that has read no assignment yet looks for one at a tenth of the
#: tick (the first assignment, written by the leader's first round, is found without
#: waiting a whole tick more)
QUICK_ROUNDS = 20

# the names these had before the worker was split up (tests patch _PartitionReader's methods)
_PartitionReader = PartitionReader
_Owned = OwnedPartition


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and wait for ``tasks``; cancel again while any survives (on Python 3.11 an
    ``asyncio.wait_for`` inside nats-py can swallow a cancellation)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


class Worker(PartitionDelivery, GroupLeader, GroupWatch, EpochSwitch):
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
        #: at every grant (a handler object's own ``applied_position`` if not given); read
        #: through the member's layout epoch (a position of an earlier layout is none)
        self._sink_applied = applied_position or getattr(handler, "applied_position", None)
        self.applied_position = self._epoch_applied if self._sink_applied is not None else None
        self.member = config.member_id
        self.store: GroupStore
        self.stream: PartitionedStream
        self.owned: dict[int, OwnedPartition] = {}
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
        described = self.store.stream
        # the layout epoch the group processes (an earlier one until it finished it)
        self._enter_epoch(described, await read_group_epoch(self.nc, self.store, described))
        self._presence = GroupPresence(self.nc, self.cfg.group_config)
        await self._presence.record()
        if self.cfg.poison == "dead-letter":
            try:
                await self._ensure_dead_letter_stream()
            except NatsOrderedError as exc:  # retried (with backoff) when a message needs it
                log.warning("member %s: %s", self.member, exc)
                self._report("dead-letter", str(exc))
        self._member_lease = await self.store.heartbeat(self.member, None, self._info())
        loops = (self._heartbeat_loop(), self._leader_loop(), self._reconcile_loop())
        for coro in (*loops, self._epoch_loop()):  # the first three: see _switch_epoch
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
                # bounded by one renewal interval: during a leader election of the lease
                # bucket nothing answers, and nats-py's 5 s per call would hold every
                # renewal (and the member's return) back for seconds after it ended
                async with asyncio.timeout(self._call_bound()):
                    self._member_lease = await self.store.heartbeat(
                        self.member, self._member_lease, self._info()
                    )
                self.last_heartbeat = time.monotonic()
            except (TimeoutError, NatsError) as exc:
                self._trouble("heartbeat failed", exc)
            # all renewals in one round trip (each under its partition's lock): sequential
            # renewals behind a busy event loop could outlast the lease margin
            await asyncio.gather(*(self._renew(o) for o in list(self.owned.values())))
            self.renew_seconds = time.monotonic() - started
            if self._leader_lease is not None:
                try:
                    await self.store.renew(self._leader_lease)
                except (TimeoutError, LeaseLost, NatsError):
                    self._leader_lease = None

    async def _renew(self, o: OwnedPartition) -> None:
        async with o.lock:
            if o.releasing:
                return  # handing over: its final commit and release own the lease
            try:
                # a renewal with no answer is retried next round (a lost reply of an
                # applied one is adopted then, see GroupLeases.renew)
                async with asyncio.timeout(self._call_bound()):
                    await self.store.renew(o.lease)
                self._audit_lease(o.partition, o.lease, o.grant.token)
            except LeaseLost as exc:
                self._lease_lost(o, exc)
            except (NatsError, TimeoutError) as exc:
                self._trouble("renewing partition %d failed", exc, o.partition)

    def _call_bound(self) -> float:
        """How long one group-state call of the background loops may wait for an answer:
        one renewal interval, at least a second. A KV call to a bucket whose stream is
        electing a leader gets no answer at all; giving up early retries it soon after
        the election instead of after nats-py's 5 s timeout."""
        return max(1.0, self.cfg.group_config.renew_interval)

    def _lease_lost(self, o: OwnedPartition, exc: LeaseLost) -> None:
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

    async def _reconcile_loop(self) -> None:
        quick = QUICK_ROUNDS
        while True:
            # a member that has read no assignment yet looks again every tick / 10 (at most
            # QUICK_ROUNDS times): the leader writes the first one a tick after it joined,
            # and a whole tick more before the first claim was a tenth of a 100k-record run
            if self._assignment_rev or quick <= 0:
                await asyncio.sleep(self.cfg.tick)
            else:
                quick -= 1
                await asyncio.sleep(self.cfg.tick / 10)
            if self._stopping:
                return
            try:
                async with asyncio.timeout(self._call_bound()):
                    data, rev = await self.store.read_assignment()
            except (TimeoutError, NatsError) as exc:
                self._trouble("reading the assignment failed", exc)
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
            todo = []
            for p in sorted(self._mine - set(self.owned)):
                previous = self._previous.get(p)
                if previous is not None and not previous.done():
                    continue  # on_assign(p) never runs before this member's on_revoke(p) ended
                if time.monotonic() < self._claim_backoff.get(p, (0.0, 0.0))[0]:
                    continue
                todo.append(p)
            if self.on_assign is None and self.fencing_floor is None:
                # no handler hooks to call one partition at a time: claim them all at once
                # (one after another, the claims of a member starting up waited behind
                # the slices of handler work of the partitions already claimed: the last
                # of 16 began half-way through a 100k-record backlog)
                await asyncio.gather(*(self._claim(p) for p in todo))
            else:
                for p in todo:
                    if self._stopping:
                        return
                    await self._claim(p)
            if self._mine and self._mine <= self.claimed:
                self._assigned.set()

    async def _claim(self, p: int) -> None:
        """Claim ``p`` (:meth:`_try_claim`); a failure is reported, and retried next tick
        or after a back-off."""
        if self._stopping:
            return
        try:
            await self._try_claim(p)
        except (NatsError, TimeoutError) as exc:
            # a blip (server restart, leader change): next tick
            self._trouble("claiming partition %d failed", exc, p)
        except NatsOrderedError as exc:
            # not a blip (a contended token, a missing commit record, a re-created
            # stream): retry later and later, and say so in the status
            self._trouble("claiming partition %d failed", exc, p)
            self._back_off(p, f"claiming failed: {exc}")

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
        # each group-state step bounded (the handler's hooks are not): a bucket electing a
        # leader answers nothing; a claim cancelled by stop() gives back what it got
        key, bound = state_key(self.store.epoch, "p", p), self._call_bound()
        lease = await claim_lease(self.store, key, self.member, bound)
        if lease is None:
            return
        try:
            floor = await self._floor(p)
            async with asyncio.timeout(self._call_bound()):
                grant = await self.store.grant(p, self.member, floor=floor)
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
        owned = OwnedPartition(p, lease, grant)
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
