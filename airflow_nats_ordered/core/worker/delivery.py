"""Delivering an owned partition's messages to the handler (:class:`Delivery`, a part of
:class:`~.worker.Worker`).

One task per partition a member owns (:meth:`Delivery.run_partition`) reads it with a
:class:`~..stream.reader.PartitionReader` from the committed position and hands its messages
to the handler one by one (or batch by batch; the calls in :mod:`.handler_calls`): with
retries, the poison policy (dead letters in :mod:`.dead_letters`), commits at a cadence
(:mod:`.committer`), and on hand-over a last commit, the lease's release and ``on_revoke``.
Before anything of a newly granted partition is handled, the group's committed position
and the sink's applied position are checked against the stream's history; a partition
whose positions are not part of it any more, or whose sink can neither apply nor skip a
message, is held for an operator (:mod:`.continuity`).

Guarantees (each tested by breaking it in ``tests/core/worker/test_worker_chaos.py``)
------------------------------------------------------------------------
* **Order.** One task per partition reads it from the committed position with one reader,
  and calls the handler message by message (or batch by batch) in stream order.
* **At-least-once.** Positions are committed after the handler returned, every
  ``commit_every`` messages / ``commit_interval`` seconds and on hand-over, so a crash
  re-delivers at most the uncommitted tail; a fenced sink makes it effectively-once. A
  write is on the wire when it is submitted (:mod:`.committer`: one in flight per
  partition, coalesced to the latest position, never after the lease is lost). A
  synchronous handler's partition also commits whenever it gives the event loop up (before
  a fetch, every :data:`YIELD_EVERY` s of handling) and then waits for the answer while
  the other partitions run, so a crash re-delivers at most what the partition in hand
  handled since its last commit point (at most ``commit_every``); an async handler's
  partition waits only when ``2 * commit_every`` messages are uncommitted.
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
import logging
import time
from collections.abc import Callable, Mapping
from inspect import isawaitable
from typing import Any

from nats.errors import Error as NatsError

from airflow_nats_ordered.core.errors import (
    BatchFailed,
    NatsOrderedError,
    OrderConflict,
    StreamNotFoundError,
)
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.leases import LeaseLost
from airflow_nats_ordered.core.group.stream_identity import StateWentBack, StreamRecreated
from airflow_nats_ordered.core.stream.continuity import delivering
from airflow_nats_ordered.core.stream.keys import HDR_KEY, HDR_KEY_B64
from airflow_nats_ordered.core.stream.message import (
    HDR_MSG_ID,
    AppliedPosition,
    BatchHandler,
    Handler,
    Message,
    MessageSlots,
)
from airflow_nats_ordered.core.stream.reader import PartitionReader
from airflow_nats_ordered.core.stream.routing_check import route_key
from airflow_nats_ordered.core.worker.backoff import ClaimBackoff
from airflow_nats_ordered.core.worker.committer import PartitionCommitter
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.continuity import Continuity
from airflow_nats_ordered.core.worker.dead_letters import DeadLetters
from airflow_nats_ordered.core.worker.handler_calls import HandlerCalls
from airflow_nats_ordered.core.worker.owned import OwnedPartition

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

#: a synchronous handler gives the event loop up (the heartbeat, the other partitions and
#: the answers to commit writes get a turn) at least this often, in seconds
YIELD_EVERY = 0.005
#: the longest a partition waits for a commit write's answer before it goes on
ANSWER_WAIT = 1.0


class Delivery:
    """A member's delivery of the partitions it owns to the handler (see the module): one
    task per partition (:meth:`run_partition`), started by the reconcile loop."""

    def __init__(
        self,
        ctx: MemberContext,
        handler: Handler | BatchHandler,
        backoff: ClaimBackoff,
        on_revoke: Callable[[int], Any] | None,
        applied_position: AppliedPosition | None,
    ) -> None:
        #: read here: the connection, store and stream; written: owned partitions (a
        #: partition's task removes its own entry when it ends), problems, the audit trail
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.member = ctx.member
        self.stats = ctx.stats  # (the context's: counted here, published by the member)
        #: the handler, called message by message or batch by batch
        self.calls = HandlerCalls(handler)
        #: where poison goes with ``poison="dead-letter"``
        self.dead_letters = DeadLetters(ctx)
        #: a partition handed back because a sink hook failed is claimed again later
        self.backoff = backoff
        self.on_revoke = on_revoke
        #: a partition's positions checked against the stream's history; held if not
        self.continuity = Continuity(ctx, applied_position)
        self._is_async = self.calls.is_async
        #: when a synchronous handler's partition last gave the event loop up
        self._last_yield = time.monotonic()

    async def run_partition(self, o: OwnedPartition) -> None:
        """Process ``o`` until it is revoked, its lease is lost or it must stop (the
        partition's task), then hand it back (see the module)."""
        p, grant = o.partition, o.grant
        subject = self.ctx.stream.subject(p)  # the subject in the member's layout epoch
        reader = PartitionReader(
            self.ctx.nc,
            self.ctx.stream.name,
            subject,
            grant.committed + 1,
            self.cfg.fetch_batch,
            self._buffer_share,
            lambda seq, msg_id: self.continuity.verify_position(p, seq, msg_id),
            grant.committed_id or None,
        )
        #: commit writes leave the hot path: one in flight, coalesced to the latest position
        committer = o.committer = PartitionCommitter(self.ctx.store, grant, o.lease, self.member)
        last, last_id = grant.committed, grant.committed_id or None
        last_commit = time.monotonic()
        since_commit = 0
        handled = 0  # messages handled and submitted for commit, in total
        graceful = False
        given_up = False  # fenced or lease lost: stop without committing, free what is held
        halted = False  # the handler could not finish a message: stop here, commit before it
        #: why the partition must stop and wait for an operator (positions that are not in
        #: the stream's history any more, a message the sink can neither apply nor skip)
        stopped: str | None = None
        lease, revoke, is_async = o.lease, o.revoke, self._is_async
        call_one = self.calls.call_one
        one_sync = not is_async and not self.cfg.batch_handler  # (the fast paths below)
        handler: Any = self.calls.handler  # (a Handler: not in batch mode on the fast path)
        revoke_is_set, monotonic, stats = revoke.is_set, time.monotonic, self.stats
        set_delivering, reset_delivering = delivering.set, delivering.reset
        every, interval = self.cfg.commit_every, self.cfg.commit_interval
        try:
            stopped = await self.continuity.check(o)
            while stopped is None and not o.revoke.is_set() and not halted:
                if not o.lease.valid:
                    raise LeaseLost(f"lease of partition {p} expired locally")
                wait = max(0.05, min(0.5, o.lease.valid_until - time.monotonic()))
                try:
                    fetched = await reader.fetch(timeout=wait)
                except StateWentBack as exc:
                    stopped = self.continuity.went_back(p, str(exc), None, exc.last_seq)
                    break
                msgs, rejected = self._messages(o, fetched)
                if one_sync and not rejected and o.processed_once:
                    # a synchronous handler's fast path: stretches of messages handled back
                    # to back up to the next commit point (every, interval, YIELD_EVERY),
                    # failure or revocation (what the general path below does message by
                    # message, with the same checks in the same order: see the notes)
                    i, n = 0, len(msgs)
                    while i < n:
                        start = i
                        failed: Exception | None = None
                        pending: Any = None
                        token = None
                        now = monotonic()
                        try:
                            while i < n:
                                if revoke_is_set():
                                    break
                                # (the clock read after the previous message: nothing but
                                # the checks below ran since)
                                if now >= lease.valid_until:
                                    raise LeaseLost(f"lease of partition {p} expired locally")
                                m = msgs[i]
                                # under `delivering` (HandlerCalls.call_one's mapping); set
                                # per message, reset once for the stretch: nothing but this
                                # loop runs in between (no await)
                                msg_id = m.headers.get(HDR_MSG_ID)
                                t = set_delivering({(p, m.stream_seq): msg_id} if msg_id else {})
                                if token is None:
                                    token = t
                                try:
                                    r = handler(m)
                                except (Fenced, OrderConflict):
                                    raise
                                except Exception as exc:
                                    failed = exc
                                    break
                                if r is not None and isawaitable(r):
                                    pending = r
                                    break
                                i += 1
                                now = monotonic()
                                if (
                                    i - start + since_commit >= every
                                    or now - last_commit >= interval
                                    or now - self._last_yield > YIELD_EVERY
                                ):
                                    break
                        except OrderConflict as exc:
                            stopped = self.continuity.refused(msgs[i], exc)
                        finally:
                            if token is not None:
                                reset_delivering(token)
                            if i > start:
                                o.processed += i - start
                                stats["processed"] += i - start
                                since_commit += i - start
                                last = msgs[i - 1].stream_seq
                                last_id = msgs[i - 1].headers.get(HDR_MSG_ID)
                        if stopped is not None:
                            break
                        if failed is not None or pending is not None:
                            # as the general path's first call: finished (an awaitable), or
                            # retried / dead-lettered in _deliver
                            m = msgs[i]
                            try:
                                if pending is not None:
                                    failed = await self.calls.finish_one(m, pending)
                                if failed is None:
                                    o.processed += 1
                                    stats["processed"] += 1
                                    done = 1
                                else:
                                    done = await self._deliver(o, [m], rejected, failed)
                            except OrderConflict as exc:
                                stopped = self.continuity.refused(m, exc)
                                break
                            if not done:
                                halted = True
                                break
                            i += 1
                            last, last_id = m.stream_seq, m.headers.get(HDR_MSG_ID)
                            since_commit += 1
                        now = monotonic()
                        yielding = now - self._last_yield > YIELD_EVERY
                        if since_commit and (
                            yielding or since_commit >= every or now - last_commit >= interval
                        ):
                            handled += since_commit
                            await self._commit_point(committer, last, last_id, handled)
                            since_commit, last_commit = 0, monotonic()
                        elif yielding:
                            await self._give_way()
                        if committer.fenced is not None:
                            raise committer.fenced
                        if revoke_is_set():
                            break
                else:
                    step = max(1, len(msgs)) if self.cfg.batch_handler else 1
                    for i in range(0, len(msgs), step):
                        if revoke.is_set():
                            break
                        if time.monotonic() >= lease.valid_until:
                            raise LeaseLost(f"lease of partition {p} expired locally")
                        chunk = msgs[i : i + step]
                        try:
                            if one_sync and not rejected and o.processed_once:
                                # _deliver's first call of a synchronous handler, without a
                                # coroutine per message; a failure goes on in _deliver
                                failed = call_one(chunk[0])
                                if failed is not None and not isinstance(failed, Exception):
                                    failed = await self.calls.finish_one(chunk[0], failed)
                                if failed is None:
                                    o.processed += 1
                                    self.stats["processed"] += 1
                                    done = 1
                                else:
                                    done = await self._deliver(o, chunk, rejected, failed)
                            else:
                                done = await self._deliver(o, chunk, rejected)
                        except OrderConflict as exc:
                            stopped = self.continuity.refused(chunk[0], exc)
                            break
                        if done:
                            last = chunk[done - 1].stream_seq
                            last_id = chunk[done - 1].headers.get(HDR_MSG_ID)
                            since_commit += done
                        if done < len(chunk):
                            halted = True
                            break
                        # a synchronous handler holds the event loop until its partition gives
                        # it up: that is a commit point too, so no partition waits for its turn
                        # with handled messages not on the wire
                        # (_yield_due and _commit_due on one reading of the clock)
                        now = time.monotonic()
                        yielding = not is_async and now - self._last_yield > YIELD_EVERY
                        if since_commit and (
                            yielding or since_commit >= every or now - last_commit >= interval
                        ):
                            handled += since_commit
                            await self._commit_point(committer, last, last_id, handled)
                            since_commit, last_commit = 0, time.monotonic()
                        elif yielding:
                            await self._give_way()
                        if committer.fenced is not None:
                            raise committer.fenced
                # handled: let go of them before fetching more (the byte bound counts on it)
                msgs = chunk = []
                # (before a fetch, which may give the loop up, a synchronous handler's
                # partition commits what it handled)
                if stopped is None and (
                    (since_commit and not self._is_async)
                    or self._commit_due(since_commit, last_commit)
                ):
                    handled += since_commit
                    await self._commit_point(committer, last, last_id, handled)
                    since_commit, last_commit = 0, time.monotonic()
                if committer.fenced is not None:
                    raise committer.fenced
            if stopped is not None:
                # no commit: what was handled since the last one may be past the stream's end
                given_up = True
                await self.continuity.hold(o, stopped)
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
            self.ctx.report("stream", str(exc))
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
            self.backoff.failed(p, str(exc))
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
                if graceful and o.lease.valid:
                    # the write in flight ends first: the final commit below is the last
                    await committer.settle(timeout=max(0.1, o.lease.valid_until - time.monotonic()))
                else:
                    committer.cancel()
                await reader.close()
                async with o.lock:
                    o.releasing = True
                    if graceful and o.lease.valid:
                        with contextlib.suppress(Fenced, NatsError, asyncio.TimeoutError):
                            await self.ctx.store.commit(grant, last, last_id)
                        with contextlib.suppress(NatsError, asyncio.TimeoutError):
                            await self.ctx.store.release(o.lease)
                    elif given_up:
                        # no commit (a newer owner may exist), but a lease key still at our
                        # revision is ours: delete it (compare-and-set, so never a newer
                        # owner's) so the partition moves at once rather than after a TTL
                        with contextlib.suppress(NatsError, asyncio.TimeoutError):
                            await self.ctx.store.release(o.lease)
            finally:
                # even if the clean-up above is interrupted: a partition left in `owned`
                # without a live task would never be claimed again by this member
                o.releasing = True
                if self.ctx.owned.get(p) is o:  # never drop a newer claim of the same partition
                    del self.ctx.owned[p]
                self.ctx.audit(
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

    def _messages(
        self, o: OwnedPartition, fetched: list[tuple[int, Any]]
    ) -> tuple[list[Message], dict[int, str]]:
        """The handler's view of fetched deliveries, and why those that must not reach it
        are rejected (by stream sequence): a key that does not hash to this partition, a
        missing key where the stream requires one, an undecodable key header."""
        p, token, partitions = o.partition, o.grant.token, self.ctx.stream.partitions
        keys_required = bool(getattr(self.ctx.stream, "keys_required", False))
        msgs: list[Message] = []
        rejected: dict[int, str] = {}
        # route_key depends only on the two key headers (and the partition): a key seen
        # before on this partition is not decoded and hashed again (bounded memory)
        routed = o.routed
        if len(routed) > 10_000:
            routed.clear()
        append = msgs.append
        # each Message is built on its slots (new_message's way, inlined: a call per
        # message was a third of its cost)
        blank, new, message_type = MessageSlots, object.__new__, Message
        for seq, d in fetched:
            headers = d.headers or {}
            ident = (headers.get(HDR_KEY), headers.get(HDR_KEY_B64))
            found = routed.get(ident)
            if found is None:
                key, why = route_key(headers, p, partitions, keys_required=keys_required)
                found = routed[ident] = (key or "", why)
            if found[1] is not None:
                rejected[seq] = found[1]
            m: Any = new(blank)
            m.key = found[0]
            m.data = d.data
            m.headers = headers
            m.partition = p
            m.stream_seq = seq
            m.fencing_token = token
            m.subject = d.subject
            m.__class__ = message_type
            append(m)
        return msgs, rejected

    def _buffer_share(self) -> int:
        """One partition's share of ``max_buffer_bytes``."""
        return self.cfg.max_buffer_bytes // max(1, len(self.ctx.owned))

    def _commit_due(self, since_commit: int, last_commit: float) -> bool:
        return since_commit > 0 and (
            since_commit >= self.cfg.commit_every
            or time.monotonic() - last_commit >= self.cfg.commit_interval
        )

    def _yield_due(self) -> bool:
        """A synchronous handler never yields: the heartbeat and the other partitions get a
        turn at least every :data:`YIELD_EVERY` seconds, or leases would starve and expire."""
        return not self._is_async and time.monotonic() - self._last_yield > YIELD_EVERY

    async def _give_way(self) -> None:
        self._last_yield = time.monotonic()
        await asyncio.sleep(0)

    async def _commit_point(
        self, committer: PartitionCommitter, seq: int, msg_id: str | None, handled: int
    ) -> None:
        """Commit ``seq`` (the ``handled``-th message): the write is on the wire at once
        (:meth:`PartitionCommitter.submit`). A synchronous handler's partition then gives
        the loop up until the write is answered (at most :data:`ANSWER_WAIT` s; the other
        partitions run meanwhile), so a partition not in hand never holds handled messages
        that are not committed or on the wire: a crash re-delivers at most what the
        partition in hand handled since its last commit point. An async handler's partition
        goes on while the write is in flight (its handler gives the loop up anyway), and
        waits only when more than two periods are uncommitted."""
        await committer.submit(seq, msg_id, handled)
        if self._is_async:
            await committer.wait_behind(handled, 2 * self.cfg.commit_every, ANSWER_WAIT)
        elif committer.busy:
            self._last_yield = time.monotonic()
            await committer.wait_answered(ANSWER_WAIT)
        elif self._yield_due():
            await self._give_way()

    async def _deliver(
        self,
        o: OwnedPartition,
        msgs: list[Message],
        rejected: Mapping[int, str] | None = None,
        failed: Exception | None = None,
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
        ones that fail on their own are dead-lettered.

        ``failed``: what the handler's first call with ``msgs[0]`` (one by one) already
        raised (the partition's fast path made that call); handled as if raised here."""
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
            end = len(msgs)
            if rejected:
                end = next((i for i in range(done + 1, end) if msgs[i].stream_seq in rejected), end)
            chunk = msgs[done : done + 1] if one_by_one else msgs[done:end]
            error: Exception | None
            if failed is not None:
                applied, error, failed = 0, failed, None
            else:
                applied, error = await self.calls.call(chunk, batch_mode)
            if applied:
                o.processed += applied
                self.stats["processed"] += applied
                if not o.processed_once:
                    await self._first_applied(o)
                done, attempt = done + applied, 0
            if error is None:
                if done < len(msgs) and self._yield_due():
                    await self._give_way()
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
        o: OwnedPartition,
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
            if o.committer is not None:
                # the marker goes after this grant's last background commit write: a drain
                # takes a commit record newer than the marker for a new owner retrying the
                # message, so a write landing after it hid the block (drains waited for
                # their timeout instead of failing at once)
                await o.committer.settle(timeout=max(0.1, o.lease.valid_until - time.monotonic()))
            await self.ctx.store.set_blocked(o.partition, o.blocked)
            # keep the lease (nobody may skip the message), stop processing
            await o.revoke.wait()
            return False
        if not o.lease.valid:
            raise LeaseLost(f"lease of partition {o.partition} expired") from error
        return await self.dead_letters.publish(o, m, reason)

    async def _first_applied(self, o: OwnedPartition) -> None:
        o.processed_once = True
        # past any message an earlier owner blocked on: clear the marker
        with contextlib.suppress(NatsError, TimeoutError):
            await self.ctx.store.set_blocked(o.partition, None)
