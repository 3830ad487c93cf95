"""The worker (:class:`Worker`): a member of a consumer group, and :func:`run_worker`.

A worker has its parts, each an object it constructs with what that part needs; what
several of them share (connection, settings, store, stream, owned partitions, statistics,
problems, audit trail, whether it is stopping) is one :class:`~.context.MemberContext`:

* :mod:`.heartbeat` - :class:`~.heartbeat.Heartbeat`: the member's key and every lease
  renewed, a lost lease stopping its partition
* :mod:`.leader` - :class:`~.leader.Leader`: the leader's loop computing the assignment
* :mod:`.reconcile` - :class:`~.reconcile.Reconciler`: the assignment followed, partitions
  claimed (:mod:`.lease_claims`, :mod:`.backoff`) and revoked
* :mod:`.delivery` - :class:`~.delivery.Delivery`: a partition's messages to the handler
  (:mod:`.handler_calls`; retries, poison policy and :mod:`.dead_letters`, batches,
  commits in :mod:`.committer`, positions checked in :mod:`.continuity`)
* :mod:`.presence` - :class:`~.presence.GroupWatch`: the group deleted under the member
* :mod:`.epochs` - :class:`~.epochs.EpochSwitch`: the member across a repartition
* :mod:`.owned` - :class:`~.owned.OwnedPartition` (a partition this member holds),
  :mod:`.config` - :class:`~.config.WorkerConfig`

The Worker itself joins and leaves (:meth:`Worker.start`, :meth:`Worker.stop`), runs the
parts' loops and stops as on a crash when one fails. ``__all__`` also names what callers
import from this module though it lives elsewhere (the settings, the handler types,
dead-letter names, :class:`GroupDeletedError`).

Guarantees (each tested by breaking it in ``tests/core/worker/test_worker_chaos.py``;
processing's in :mod:`.delivery`)
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
* **A refused permission stops the member, once.** When the server refuses one of its
  publishes or subscriptions (the NATS user lacks a permission of the worker role; a
  refusal of another part of a program sharing the connection is not its own), the
  member logs one error naming the permission, stops as on a crash and sets
  :attr:`Worker.error` to a :class:`~..errors.PermissionDenied`; it never retries what the
  server will refuse again. Refused while joining, :meth:`Worker.start` raises it.
* **A deleted group stops the member, once.** When its group's buckets are deleted (or
  deleted and created again) under it, the member logs one error, stops as on a crash and
  sets :attr:`Worker.error` to a :class:`GroupDeletedError`; it never retries against, or
  re-creates, a group an operator deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.errors import NatsOrderedError, PermissionDenied
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.message import (
    AppliedPosition,
    BatchHandler,
    Handler,
)
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.worker.backoff import ClaimBackoff
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.delivery import Delivery
from airflow_nats_ordered.core.worker.epochs import EpochSwitch, read_group_epoch
from airflow_nats_ordered.core.worker.heartbeat import Heartbeat
from airflow_nats_ordered.core.worker.leader import Leader
from airflow_nats_ordered.core.worker.owned import OwnedPartition
from airflow_nats_ordered.core.worker.presence import GroupWatch
from airflow_nats_ordered.core.worker.reconcile import Reconciler

__all__ = [
    "Worker",
    "run_worker",
]

log = logging.getLogger(__name__)


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and wait for ``tasks``; cancel again while any survives (on Python 3.11 an
    ``asyncio.wait_for`` inside nats-py can swallow a cancellation)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


class Worker:
    """One member of a consumer group. ``await start()`` joins, ``await stop()`` leaves.

    Its parts, each constructed here with what it needs (what several share is its
    :class:`~.context.MemberContext`): :attr:`watch` (the group's presence, and the error
    the member stopped with), :attr:`delivery` (owned partitions to the handler),
    :attr:`reconciler` (the reconcile loop), :attr:`leader`, :attr:`heartbeat` and
    :attr:`epochs` (the layout epoch). Its background loops, in :attr:`_tasks` in this
    order: the heartbeat, the leader's, the reconcile and the epoch loop."""

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
        self.member = config.member_id
        self.ctx = ctx = MemberContext(nc, config)
        self.watch = GroupWatch(ctx, crash=self._crash_once)
        trouble = self.watch.trouble
        #: the sink's last applied (seq, msg id) of a partition: checked against the stream
        #: at every grant (a handler object's own ``applied_position`` if not given); read
        #: through the member's layout epoch (a position of an earlier layout is none)
        sink_applied = applied_position or getattr(handler, "applied_position", None)
        self.epochs = EpochSwitch(
            ctx, trouble, sink_applied, self._pause_claims, self._resume_claims
        )
        self.applied_position = self.epochs.applied if sink_applied is not None else None
        backoff = ClaimBackoff(config, ctx.report)
        self.delivery = Delivery(ctx, handler, backoff, on_revoke, self.applied_position)
        self.reconciler = Reconciler(ctx, self.delivery, backoff, trouble, on_assign, fencing_floor)
        self.leader = Leader(ctx, trouble)
        self.heartbeat = Heartbeat(ctx, self.leader, trouble)
        #: the background loops: the heartbeat, the leader's, the reconcile and the epoch loop
        self._tasks: list[asyncio.Task[None]] = []
        self._crash: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None
        self.stopped = asyncio.Event()

    # -- what callers read -------------------------------------------------------------------
    @property
    def store(self) -> GroupStore:
        """The group's store (once :meth:`start` opened it)."""
        return self.ctx.store

    @property
    def stream(self) -> PartitionedStream:
        """The stream in the layout epoch the member processes."""
        return self.ctx.stream

    @property
    def owned(self) -> dict[int, OwnedPartition]:
        """The partitions this member holds (claimed, including those still in
        ``on_assign``)."""
        return self.ctx.owned

    @property
    def stats(self) -> dict[str, int]:
        """The member's counters (see :class:`~.context.MemberContext`)."""
        return self.ctx.stats

    @property
    def problems(self) -> dict[str, str]:
        """What keeps failing, by topic; published in the heartbeat (``status`` shows it)."""
        return self.ctx.problems

    @property
    def generation(self) -> int:
        """The assignment's generation the member last read."""
        return self.reconciler.generation

    @property
    def renew_seconds(self) -> float:
        """Seconds the last round of renewals took (member heartbeat + every lease)."""
        return self.heartbeat.renew_seconds

    @property
    def last_heartbeat(self) -> float:
        """Monotonic time of the last member heartbeat the server accepted (0: none yet)."""
        return self.heartbeat.last_heartbeat

    @property
    def error(self) -> NatsOrderedError | None:
        """Why the member stopped on its own (None: it did not, or on a loop's exception)."""
        return self.watch.error

    @property
    def claimed(self) -> set[int]:
        """The partitions this member is processing (claimed, ``on_assign`` returned)."""
        return self.reconciler.claimed()

    @property
    def assigned(self) -> set[int]:
        """The partitions the latest assignment this member read gives it."""
        return set(self.reconciler.mine)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._unwatch = denials.watch(self.nc, self._denied)
        try:
            await self._start()
        except BaseException:
            self._unwatch()
            raise
        if isinstance(self.watch.error, PermissionDenied):  # refused while joining
            self._crash_once()
            raise self.watch.error

    def _denied(self, error: PermissionDenied) -> None:
        """The server refused one of the member's operations: stop once, saying which
        permission is missing (a retry would be refused the same way)."""
        if self.watch.error is not None or self.ctx.stopping or not self._concerns(error):
            return
        self.watch.error = error
        if not self._tasks:  # while joining: start() raises it
            return
        log.error(
            "member %s: %s; the member stops: it cannot do its work without that permission",
            self.member,
            error,
        )
        self._crash_once()

    def _concerns(self, error: PermissionDenied) -> bool:
        """Whether ``error`` refused one of the member's own operations (its stream, its
        group's buckets and dead letters, its reply inboxes), not another part's of a
        program sharing the connection (an application's ``>`` subscription)."""
        store = getattr(self.ctx, "store", None)
        stream = getattr(store, "stream", None)
        prefixes = (f"{stream.prefix}.dlq.{self.cfg.group}",) if stream is not None else ()
        names = self.cfg.group_config.jetstream_names()
        return denials.concerns(self.nc, error, names=names, prefixes=prefixes)

    async def _start(self) -> None:
        ctx = self.ctx
        ctx.store = await GroupStore.open(self.nc, self.cfg.group_config)
        assert ctx.store.stream is not None  # (open() describes the stream)
        described = ctx.store.stream
        # the layout epoch the group processes (an earlier one until it finished it)
        self.epochs.enter(described, await read_group_epoch(self.nc, ctx.store, described))
        await self.watch.record()
        if self.cfg.poison == "dead-letter":
            try:
                await self.delivery.dead_letters.ensure_stream()
            except NatsOrderedError as exc:  # retried (with backoff) when a message needs it
                log.warning("member %s: %s", self.member, exc)
                ctx.report("dead-letter", str(exc))
        await self.heartbeat.join()
        loops = (self._heartbeat_loop(), self._leader_loop(), self._reconcile_loop())
        for coro in (*loops, self._epoch_loop()):  # the second and third: see _pause_claims
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
        if self.ctx.stopping:
            await self.stopped.wait()
            return
        self.ctx.stopping = True
        try:
            await self._leave()
        finally:
            if self._unwatch is not None:
                self._unwatch()
            self.heartbeat.closing = True
            for t in self._tasks:
                t.cancel()
            for o in list(self.owned.values()):
                if o.task is not None:
                    o.task.cancel()
            self.stopped.set()

    async def _leave(self) -> None:
        owned = self.owned
        # no new claims while handing over: halt the leader and reconcile loops first
        # (the heartbeat keeps renewing the leases being handed over)
        await _cancel_and_wait(self._tasks[1:])
        for o in list(owned.values()):
            o.revoke.set()
        tasks = [o.task for o in owned.values() if o.task]
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
        for o in list(owned.values()):  # still in on_assign: nothing was processed
            async with o.lock:  # not while a renewal changes the revision
                o.releasing = True
                with contextlib.suppress(Exception):
                    await self.store.release(o.lease)
            if owned.get(o.partition) is o:
                del owned[o.partition]
        self.heartbeat.closing = True
        await _cancel_and_wait(self._tasks)
        with contextlib.suppress(Exception):
            if self.leader.lease is not None:
                await self.store.release(self.leader.lease)
            if self.heartbeat.member_lease is not None:
                await self.store.release(self.heartbeat.member_lease)
        log.info("member %s left group %s", self.member, self.cfg.group)

    async def wait_assigned(self, timeout: float | None = None) -> None:
        """Return once this member has its first assignment and has claimed every
        partition in it: lease held, token granted, ``on_assign`` returned, processing
        started. Raises TimeoutError after ``timeout`` seconds (a member that the assignment
        gives no partition, with more members than partitions, waits until then), and
        NatsOrderedError if the member stops first."""
        waits = [
            asyncio.ensure_future(self.reconciler.assigned.wait()),
            asyncio.ensure_future(self.stopped.wait()),
        ]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise TimeoutError(
                f"member {self.member} has not claimed its assignment after {timeout:g}s "
                f"(assigned {sorted(self.reconciler.mine)}, claimed {sorted(self.owned)}; "
                f"problems: {sorted(self.problems.values()) or 'none'})"
            ) from None
        finally:
            for w in waits:
                w.cancel()
        if not self.reconciler.assigned.is_set():
            raise NatsOrderedError(f"member {self.member} stopped before it was assigned")

    async def run(self) -> None:
        """Start and run until :meth:`stop` is called (e.g. from a signal handler)."""
        await self.start()
        await self.stopped.wait()

    async def _guard(self, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("member %s: background loop failed; leaving the group", self.member)
            self._crash_once()

    def _crash_once(self) -> None:
        """Stop as on a crash (:meth:`_crash_stop`), once however often this is called."""
        if self._crash is None:
            self._crash = asyncio.ensure_future(self._crash_stop())

    async def _crash_stop(self) -> None:
        # lose leases without committing (as a crash would): safe, the next owner resumes
        for o in list(self.owned.values()):
            if o.task:
                o.task.cancel()
        await self.stop()

    async def _pause_claims(self) -> None:
        """Stop the leader's and the reconcile loop (an epoch switch: no claims meanwhile)."""
        await _cancel_and_wait(self._tasks[1:3])

    def _resume_claims(self) -> None:
        """Claim afresh (after an epoch switch): forget the old epoch's assignment, claims'
        back-offs and partition tasks, and start the leader's and the reconcile loop again
        (unless the member is stopping)."""
        self.reconciler.forget()
        if self.ctx.stopping:
            return
        self._tasks[1] = asyncio.ensure_future(self._guard(self._leader_loop()))
        self._tasks[2] = asyncio.ensure_future(self._guard(self._reconcile_loop()))

    # the member's background loops, each its part's (named here as a task dump shows them:
    # ``kill -USR2`` of a ``nats-ordered worker``)
    async def _heartbeat_loop(self) -> None:
        await self.heartbeat.run()

    async def _leader_loop(self) -> None:
        await self.leader.run()

    async def _reconcile_loop(self) -> None:
        await self.reconciler.run()

    async def _epoch_loop(self) -> None:
        await self.epochs.run()


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
