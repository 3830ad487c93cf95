"""The global-order reader's exact event-time mode (:class:`ProducerReading`, a mixin of
:class:`~.reader.GlobalOrderReader`): ``order_by="event-time", watermarks=True``.

Records of several :class:`~.producer.GlobalProducer` instances, on any partitions,
are handed over in increasing key ``(event time, producer, epoch, n)``
(:mod:`.producer_merge`), with no window: the smallest buffered record goes once
every registered producer that is not closed has a confirmed watermark at or above it.

**Confirming marks** (the same trick as the sequence mode's watermarks): the reader reads
every producer's mark (``p.<producer>``), *then* every partition's last stored sequence;
once it has read every partition up to that sequence, every record a mark does not cover
was stored before the mark was written, so it is buffered (or handed over): the marks are
then applied. While such a check waits, a partition it needs is read past its memory share
(at most up to the sequence it needs), so a full buffer cannot stall the check.

Guarantees: exact key order, each record once (at least once after a crash; the position
resumes exactly: up to the position's horizon, ``read``, a record is done iff its key is at
or below the position's key, because everything below the last key handed over was handed
over; past the horizon a key at or below it was never handed over and is a violation, so a
restarted reader stops where the running one did, and at a record stored below the
position while no reader ran). A record without the producer's headers, of a producer that
never registered, of a closed producer's epoch (a restart with the same id is a new epoch,
merged like any producer that joins), or below what was handed over stops the reader
before it (:class:`~.merge.GlobalOrderViolation`): never reordered, never dropped. A
registered producer that is silent (no watermark past the smallest buffered record, not
closed) holds the merge back:
the heartbeat names it (``held_back_by``, and a problem ``status`` shows after
:data:`HELD_BACK_PROBLEM` seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.order.merge import GlobalOrderViolation
from airflow_nats_ordered.core.order.producer_merge import ProducerMerge, describe_key
from airflow_nats_ordered.core.order.producers import (
    Key,
    ProducerMark,
    read_marks,
    record_key,
    show_time,
)
from airflow_nats_ordered.core.order.progress import PartitionProgress
from airflow_nats_ordered.core.order.reader_hooks import ReaderHooks
from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.stream.reader import PartitionReader

log = logging.getLogger(__name__)

#: seconds the merge may be held back by a silent producer before ``status`` shows it
HELD_BACK_PROBLEM = 5.0


def _cancelled_check() -> None:
    """Raise CancelledError if this task was cancelled: nats-py's requests (asyncio.wait_for
    on Python 3.11) can swallow a cancellation that races with the reply, and a loop that
    went on after that would never end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ProducerReading(ReaderHooks):
    """The exact event-time mode of :class:`~.reader.GlobalOrderReader` (which
    supplies the attributes and helpers annotated here)."""

    nc: NATS
    stream: PartitionedStream
    poll_interval: float
    stats: Any
    _readers: list[PartitionReader]
    _space: list[asyncio.Event]
    _wake: asyncio.Event
    _stopping: bool
    _g: int
    _tie: int
    _progress: list[PartitionProgress] | None
    _pmerge: ProducerMerge | None
    #: the key of the last record handed over (the position's), or None
    _pkey: Key | None
    _resume_pkey: Key | None
    #: per partition, the position's horizon: up to it a record at or below
    #: ``_resume_pkey`` was handed over; past it such a record is a violation
    _resume_horizon: list[int]
    #: a check waiting to be confirmed: (marks, last stored sequences, producers unknown
    #: when it began)
    _pending: tuple[dict[str, tuple[ProducerMark, int]], dict[int, int], set[str]] | None
    _last_check: float
    _held_since: float | None

    # -- reading -------------------------------------------------------------------------
    def _needed(self, p: int) -> bool:
        """A pending check needs partition ``p`` read further."""
        return self._pending is not None and self._readers[p].next_seq <= self._pending[1][p]

    async def _fetch_producers(self, p: int) -> None:
        reader, space, merge = self._readers[p], self._space[p], self._pmerge
        assert merge is not None and self._progress is not None
        progress = self._progress[p]
        while not self._stopping:
            _cancelled_check()
            if not merge.room(p) and not self._needed(p):
                space.clear()
                await space.wait()
                continue
            try:
                got = await reader.fetch(timeout=1.0)
            except Exception as exc:  # never leave a partition silently unread
                self._fail(exc)
                return
            # from here to the end of the loop nothing awaits: what the reader has handed
            # out is in the merge (the confirmation of marks relies on it)
            for seq, m in got:
                headers = dict(m.headers or {})
                progress.read(seq)
                try:
                    k = record_key(headers)
                except ValueError as exc:
                    progress.hold(seq)  # not done: the next reader stops at it too
                    self._fail(
                        GlobalOrderViolation(
                            f"partition {p}, stream sequence {seq}: {exc}: the record was not "
                            "published through a GlobalProducer, so it has no place in the "
                            "exact event-time order; the reader stops before it (read such a "
                            "stream without watermarks=True for the window mode)",
                            p,
                        )
                    )
                    return
                resumed = self._resume_pkey
                if resumed is not None and k <= resumed and seq <= self._resume_horizon[p]:
                    progress.done(seq)  # handed over before the restart (global_progress)
                    continue
                # past the horizon a key at or below the position's was never handed over:
                # stored after the position was read, it is a violation (merge.add says so)
                size = len(m.data or b"") + sum(len(a) + len(b) for a, b in headers.items())
                try:
                    item = (seq, m, headers, message_key(headers) or "")
                    merge.add(p, k, item, size, f"partition {p}, stream sequence {seq}")
                except NatsOrderedError as exc:  # a violation, or a malformed key header
                    progress.hold(seq)  # not done: the next reader stops at it too
                    self._fail(exc)
                    return
            if got:
                self._wake.set()

    # -- confirming marks ----------------------------------------------------------------
    async def _check_marks(self) -> None:
        assert self._pmerge is not None
        self._last_check = time.monotonic()
        unknown = self._pmerge.unknown()
        js = self.nc.jetstream()

        async def last(p: int) -> int:
            try:
                return (await js.get_last_msg(self.stream.name, self.stream.subject(p))).seq or 0
            except NotFoundError:
                return 0

        try:
            marks = await read_marks(self.nc, self.stream.name)  # the marks first, then
            lasts = await asyncio.gather(*(last(p) for p in range(self.stream.partitions)))
        except (NatsError, TimeoutError) as exc:  # tried again at the next poll
            log.info("global-order reader: producer marks not read: %s", exc)
            return
        self._pending = (marks, dict(enumerate(lasts)), unknown)
        for space in self._space:  # a full partition the check needs is read on
            space.set()

    def _confirm_marks(self) -> bool | None:
        """Apply the pending check's marks once every partition was read up to its last
        stored sequence: True if applied, None if not yet, False if the reader stops."""
        assert self._pmerge is not None
        if self._pending is None or any(self._needed(p) for p in range(len(self._readers))):
            return None
        marks, _, unknown = self._pending
        self._pending = None
        stray = sorted(unknown - set(marks))
        if stray:
            self._fail(
                GlobalOrderViolation(
                    f"stream {self.stream.name} has records of producer(s) {', '.join(stray)} "
                    "that never registered (no mark p.<producer> in the bucket "
                    f"nor_{self.stream.name}_global): publish only through GlobalProducer, "
                    "which registers before it publishes; the reader stops before them",
                    -1,
                )
            )
            return False
        bounds = {p: m.bound() for p, (m, _) in marks.items() if not m.closed}
        closed = {p: m.epoch for p, (m, _) in marks.items() if m.closed}
        before = dict(self._pmerge.bounds)
        self._pmerge.set_marks(bounds, closed)
        if self._pmerge.bounds != before:
            self.stats.watermark_advances += 1
        return True

    # -- the merge -------------------------------------------------------------------------
    async def _producers_loop(self) -> None:
        merge = self._pmerge
        assert merge is not None
        while not self._stopping:
            _cancelled_check()
            try:
                popped = merge.pop()
            except GlobalOrderViolation as exc:
                self._fail(exc)
                return
            if popped is not None:
                self._held_since = None
                p, k, item = popped
                self._space[p].set()
                seq = item[0]
                where = f"{describe_key(k)} (partition {p}, stream sequence {seq})"
                msg = self._message(p, k[0], item, False)
                if not await self._apply(msg, where, " (skipping it would break the order)"):
                    return
                self._pkey, self._g, self._tie = k, k[0], k[3]
                await self._handled(p, seq)
                continue
            await self._commit_if_due()
            if merge.buffered() and self._held_since is None:
                self._held_since = time.monotonic()
            confirmed = self._confirm_marks()
            if confirmed is False:
                return
            if confirmed:
                continue
            due = time.monotonic() - self._last_check >= self.poll_interval
            if self._pending is None and due:
                await self._check_marks()
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await self._wake.wait()

    def _held_back(self) -> tuple[list[str], list[str]]:
        """For the heartbeat: the producers holding the merge back, and the problem to show
        once they have for :data:`HELD_BACK_PROBLEM` seconds."""
        merge = self._pmerge
        if merge is None or not merge.buffered():
            return [], []
        holders = merge.holders()
        since = self._held_since
        if not holders or since is None or time.monotonic() - since < HELD_BACK_PROBLEM:
            return holders, []
        marks = []
        for h in holders:
            b = merge.bounds.get(h)
            marks.append(f"{h} (watermark {'none' if b is None else show_time(b[0])})")
        close = "; ".join(
            f"`nats-ordered global-producers --stream {self.stream.name} --close {h}`"
            for h in holders
        )
        return holders, [
            f"the merge is held back for {time.monotonic() - since:.0f}s by producer(s) "
            f"{', '.join(marks)}: registered, not closed, no watermark past the next record. "
            f"If it died, restart it with the same producer id, or close it ({close}; in "
            "Python close_producer(nc, stream, producer))"
        ]


__all__ = ["HELD_BACK_PROBLEM", "ProducerReading"]
