"""The global-order reader's window modes (:class:`WindowStrategy`, its merge strategy for
``order_by="time"`` and ``"event-time"``): reading partitions into the
:class:`~.window.WindowMerge`, releasing in key order, and the late-record policy.

Two keys (``docs/architecture/order.md``, *Time-window mode*):

* ``order_by="time"``: ``(stored time, stream seq)``, the time the server stored a record;
* ``order_by="event-time"``: ``(event time, stream seq)``, the producer's time from the
  header ``time_header`` (:mod:`.event_time`). Several producers, also foreign
  clients, share one order this way. A partition's records may then be handed over out of
  stream order, so what is done per partition is kept by :mod:`.progress`.

Guarantees: on-time records are handed over in exactly key order, each once (at least
once after a crash); a late record (key at or below one already handed over) gets the
late policy (``block``: stop before it, ``dead-letter``: set aside, ``flag``: hand it over
with ``late=True``), and so does, in the event-time mode, a record whose header is missing
or not a time (``dead-letter`` sets it aside, ``block`` and ``flag`` stop the reader before
it with :class:`~.event_time.EventTimeError`): nothing is reordered or dropped
without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.order.event_time import FORMS, EventTimeError, parse_event_time
from airflow_nats_ordered.core.order.late import DeadLetters
from airflow_nats_ordered.core.order.strategy import ReadingContext
from airflow_nats_ordered.core.order.window import (
    LateRecordError,
    WindowMerge,
    pending,
    stored_time_ns,
)
from airflow_nats_ordered.core.stream.keys import message_key


class WindowStrategy:
    """Merges with ``merge`` in a window of ``lateness`` seconds, applying the late-record
    policy ``late`` and setting records aside with ``dead_letters``.

    ``time_header``: the event-time mode's header (None: the time mode, by stored time);
    the event-time mode keeps a :class:`~.progress.PartitionProgress` per partition in the
    context's progress, and resumes by ``resume_key`` (the position's ``(g, tie)``) up to
    ``resume_horizon`` (the position's ``read``, per partition)."""

    def __init__(
        self,
        context: ReadingContext,
        merge: WindowMerge,
        *,
        lateness: float,
        late: str,
        dead_letters: DeadLetters,
        time_header: str | None = None,
        resume_key: tuple[int, int] = (0, 0),
        resume_horizon: list[int] | None = None,
    ) -> None:
        if (time_header is None) != (context.progress.partitions is None):
            raise ValueError("the event-time mode, and only it, keeps progress per partition")
        self.context = context
        self.merge = merge
        self.lateness = lateness
        self.late = late
        self.dead_letters = dead_letters
        self.time_header = time_header
        self.resume_key = resume_key
        self.resume_horizon = resume_horizon or []
        #: late records (and, event-time mode, records without a time: ``why`` is the
        #: reason) waiting for the policy: (partition, key time, record, why)
        self._late: deque[tuple[int, int, Any, str | None]] = deque()

    # -- reading -------------------------------------------------------------------------
    async def fetch(self, p: int) -> None:
        ctx, merge = self.context, self.merge
        reader, space = ctx.readers[p], ctx.space[p]
        while not ctx.stopping():
            if not merge.room(p):
                merge.stalled(p)
                space.clear()
                await space.wait()
                continue
            try:
                got = await reader.fetch(timeout=1.0)
            except Exception as exc:  # never leave a partition silently unread
                ctx.fail(exc)
                return
            if not got:
                merge.idle(p)  # nothing came within the fetch's wait: caught up
            for seq, m in got:
                headers = dict(m.headers or {})
                reply = m.reply or ""
                size = len(m.data or b"") + sum(len(k) + len(v) for k, v in headers.items())
                try:
                    key = message_key(headers) or ""
                except NatsOrderedError as exc:  # a malformed key header
                    ctx.fail(exc)
                    return
                t = stored_time_ns(reply)
                item = (seq, m, headers, key)
                if self.time_header is not None:
                    self._read_event(p, t, item, size, pending(reply) == 0)
                elif merge.add(p, t, seq, item, size, pending(reply) == 0):
                    self._late.append((p, t, item, None))
            ctx.wake.set()

    def _read_event(self, p: int, stored: int, item: Any, size: int, caught_up: bool) -> None:
        """Event-time mode: place one record read from partition ``p`` (no awaits)."""
        partitions, merge = self.context.progress.partitions, self.merge
        assert partitions is not None and self.time_header is not None
        seq, _, headers, _ = item
        progress = partitions[p]
        progress.read(seq)
        try:
            e: int | None = parse_event_time(headers.get(self.time_header))
            why = None
        except ValueError as exc:
            e, why = None, str(exc)
        if seq <= self.resume_horizon[p] and (e is None or (e, seq) <= self.resume_key):
            merge.seen(p, stored, caught_up)  # done before the restart (progress)
            progress.done(seq)
            return
        if e is None:
            merge.seen(p, stored, caught_up)
            progress.hold(seq)
            self._late.append((p, 0, item, why))
        elif merge.add_event(p, (e, seq), stored, item, size, caught_up):
            progress.hold(seq)
            self._late.append((p, e, item, None))

    # -- releasing -----------------------------------------------------------------------
    async def release(self) -> None:
        ctx, merge = self.context, self.merge
        while not ctx.stopping():
            if self._late:
                p, t, item, why = self._late.popleft()
                if why is None:
                    ok = await self._late_record(p, t, item)
                else:
                    ok = await self._untimed_record(p, item, why)
                if not ok:
                    return
                continue
            now = time.time_ns()
            popped = merge.pop(now)
            if popped is None:
                await ctx.commit_if_due()
                due = merge.wait_ns(now)
                wait = ctx.poll_interval if due is None else min(ctx.poll_interval, due / 1e9)
                ctx.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.001, wait)):
                        await ctx.wake.wait()
                continue
            p, (t, tie), item = popped
            ctx.space[p].set()
            if not await self._hand(p, t, item, late=False, tie=tie):
                return

    async def _hand(self, p: int, t: int, item: Any, late: bool, tie: int = 0) -> bool:
        """Hand a window record to the handler; False if the reader stops. An on-time one
        becomes the position's key ``(t, tie)`` before it is counted (and maybe committed)."""
        ctx = self.context
        seq = item[0]
        if not await ctx.hand(p, t, item, late, f"partition {p}, stream sequence {seq}", ""):
            return False
        if not late:
            ctx.progress.g, ctx.progress.tie = t, tie
        await ctx.handled(p, seq)
        return True

    async def _late_record(self, p: int, t: int, item: Any) -> bool:
        """Apply the late-record policy; False if the reader stops."""
        ctx, progress = self.context, self.context.progress
        seq = item[0]
        ctx.stats.late += 1
        progress.late += 1
        progress.unwritten += 1  # the count is written with the position
        behind = (progress.g - t) / 1e9
        what = "with an event time" if self.time_header is not None else "stored"
        reason = (
            f"late record: partition {p}, stream sequence {seq}, {what} {behind:.3f}s before "
            f"a record already handed over (lateness {self.lateness:g}s)"
        )
        if self.late == "flag":
            return await self._hand(p, t, item, late=True)
        if self.late == "block":
            ctx.fail(
                LateRecordError(
                    f"{reason}: the reader stops before it (late='block'). Pass a larger "
                    "lateness, or late='dead-letter' to set late records aside, or "
                    "late='flag' to hand them over flagged",
                    p,
                    seq,
                )
            )
            return False
        return await self._set_aside(p, item, reason)

    async def _untimed_record(self, p: int, item: Any, why: str) -> bool:
        """Event-time mode: a record without a usable time has no place in the order:
        ``late="dead-letter"`` sets it aside, otherwise the reader stops before it."""
        ctx, header = self.context, self.time_header
        assert header is not None
        seq = item[0]
        reason = f"no event time: header {header} of partition {p}, stream sequence "
        reason += f"{seq}: {why}"
        if self.late != "dead-letter":
            ctx.fail(
                EventTimeError(
                    f"{reason}. The record has no place in the event-time order, so the "
                    f"reader stops before it (late={self.late!r}). Have its producer "
                    f"set {header} ({FORMS}), pass the header it does set as "
                    "time_header, or pass late='dead-letter' to set such records aside",
                    p,
                    seq,
                    header,
                    why,
                )
            )
            return False
        ctx.stats.untimed += 1
        ctx.progress.unwritten += 1
        return await self._set_aside(p, item, reason)

    async def _set_aside(self, p: int, item: Any, reason: str) -> bool:
        ctx = self.context
        if not await self.dead_letters.set_aside(p, item, reason, ctx.stopping):
            return False  # stopping: not set aside, so it is read again next time
        ctx.stats.dead_lettered += 1
        ctx.progress.done(p, item[0])
        return True

    def held_back(self) -> tuple[list[str], list[str]]:
        return [], []  # only the exact event-time mode names what holds its merge back


__all__ = ["WindowStrategy"]
