"""The global-order reader's window modes (:class:`WindowReading`, a mixin of
:class:`~.reader.GlobalOrderReader`): reading partitions into the
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
from airflow_nats_ordered.core.order.late import set_aside
from airflow_nats_ordered.core.order.progress import PartitionProgress
from airflow_nats_ordered.core.order.reader_hooks import ReaderHooks
from airflow_nats_ordered.core.order.window import (
    LateRecordError,
    WindowMerge,
    pending,
    stored_time_ns,
)
from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.reader import PartitionReader


class WindowReading(ReaderHooks):
    """The window modes of :class:`~.reader.GlobalOrderReader` (which supplies the
    attributes and the helpers annotated here)."""

    order_by: str
    time_header: str
    lateness: float
    late: str
    poll_interval: float
    stats: Any
    error: BaseException | None
    _window: WindowMerge | None
    _readers: list[PartitionReader]
    _space: list[asyncio.Event]
    _wake: asyncio.Event
    _stopping: bool
    _token: int
    _g: int
    _tie: int
    _late_total: int
    _uncommitted: int
    _seqs: dict[int, int]
    #: late records (and, event-time mode, records without a time: ``why`` is the reason)
    #: waiting for the policy: (partition, key time, record, why)
    _late: deque[tuple[int, int, Any, str | None]]
    #: event-time mode: per partition what is done, and what the resumed position covered
    _progress: list[PartitionProgress] | None
    _resume_key: tuple[int, int]
    _resume_horizon: list[int]

    # -- reading -------------------------------------------------------------------------
    async def _fetch_window(self, p: int) -> None:
        reader, space = self._readers[p], self._space[p]
        merge = self._window
        assert merge is not None
        while not self._stopping:
            if not merge.room(p):
                merge.stalled(p)
                space.clear()
                await space.wait()
                continue
            try:
                got = await reader.fetch(timeout=1.0)
            except Exception as exc:  # never leave a partition silently unread
                self._fail(exc)
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
                    self._fail(exc)
                    return
                t = stored_time_ns(reply)
                item = (seq, m, headers, key)
                if self._progress is not None:
                    self._read_event(p, merge, t, item, size, pending(reply) == 0)
                elif merge.add(p, t, seq, item, size, pending(reply) == 0):
                    self._late.append((p, t, item, None))
            self._wake.set()

    def _read_event(
        self, p: int, merge: WindowMerge, stored: int, item: Any, size: int, caught_up: bool
    ) -> None:
        """Event-time mode: place one record read from partition ``p`` (no awaits)."""
        assert self._progress is not None
        seq, _, headers, _ = item
        progress = self._progress[p]
        progress.read(seq)
        try:
            e: int | None = parse_event_time(headers.get(self.time_header))
            why = None
        except ValueError as exc:
            e, why = None, str(exc)
        if seq <= self._resume_horizon[p] and (e is None or (e, seq) <= self._resume_key):
            merge.seen(p, stored, caught_up)  # done before the restart (global_progress)
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
    async def _window_loop(self) -> None:
        merge = self._window
        assert merge is not None
        while not self._stopping:
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
                await self._commit_if_due()
                due = merge.wait_ns(now)
                wait = self.poll_interval if due is None else min(self.poll_interval, due / 1e9)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.001, wait)):
                        await self._wake.wait()
                continue
            p, (t, tie), item = popped
            self._space[p].set()
            if not await self._hand(p, t, item, late=False, tie=tie):
                return

    async def _hand(self, p: int, t: int, item: Any, late: bool, tie: int = 0) -> bool:
        """Hand a window record to the handler; False if the reader stops. An on-time one
        becomes the position's key ``(t, tie)`` before it is counted (and maybe committed)."""
        seq = item[0]
        msg = self._message(p, t, item, late)
        if not await self._apply(msg, f"partition {p}, stream sequence {seq}"):
            return False
        if not late:
            self._g, self._tie = t, tie
        await self._handled(p, seq)
        return True

    async def _late_record(self, p: int, t: int, item: Any) -> bool:
        """Apply the late-record policy; False if the reader stops."""
        seq = item[0]
        self.stats.late += 1
        self._late_total += 1
        self._uncommitted += 1  # the count is written with the position
        behind = (self._g - t) / 1e9
        what = "with an event time" if self._progress is not None else "stored"
        reason = (
            f"late record: partition {p}, stream sequence {seq}, {what} {behind:.3f}s before "
            f"a record already handed over (lateness {self.lateness:g}s)"
        )
        if self.late == "flag":
            return await self._hand(p, t, item, late=True)
        if self.late == "block":
            self._fail(
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
        seq = item[0]
        reason = f"no event time: header {self.time_header} of partition {p}, stream sequence "
        reason += f"{seq}: {why}"
        if self.late != "dead-letter":
            self._fail(
                EventTimeError(
                    f"{reason}. The record has no place in the event-time order, so the "
                    f"reader stops before it (late={self.late!r}). Have its producer set "
                    f"{self.time_header} ({FORMS}), pass the header it does set as "
                    "time_header, or pass late='dead-letter' to set such records aside",
                    p,
                    seq,
                    self.time_header,
                    why,
                )
            )
            return False
        self.stats.untimed += 1
        self._uncommitted += 1
        return await self._set_aside(p, item, reason)

    async def _set_aside(self, p: int, item: Any, reason: str) -> bool:
        if not await set_aside(self, p, item, reason):
            return False  # stopping: not set aside, so it is read again next time
        self.stats.dead_lettered += 1
        self._done(p, item[0])
        return True

    def _done(self, p: int, seq: int) -> None:
        """Record ``seq`` of partition ``p`` as done (handed over or set aside)."""
        if self._progress is None:
            self._seqs[p] = seq
            return
        progress = self._progress[p]
        progress.done(seq)
        if progress.prefix:
            self._seqs[p] = progress.prefix

    def _horizons(self) -> dict[int, int] | None:
        if self._progress is None:
            return None
        return {p: h for p, pr in enumerate(self._progress) if (h := pr.horizon())}


__all__ = ["WindowReading"]
