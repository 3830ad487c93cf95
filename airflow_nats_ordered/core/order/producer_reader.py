"""The global-order reader's exact event-time mode (:class:`ProducerStrategy`, its merge
strategy for ``order_by="event-time", watermarks=True``).

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

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
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
from airflow_nats_ordered.core.order.strategy import ReadingContext
from airflow_nats_ordered.core.stream.keys import message_key

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


class ProducerStrategy:
    """Merges by producer key with ``merge``; resumes by ``resume_key`` (the position's key,
    or None) up to ``resume_horizon`` (the position's ``read``, per partition). Keeps a
    :class:`~.progress.PartitionProgress` per partition in the context's progress."""

    def __init__(
        self,
        context: ReadingContext,
        merge: ProducerMerge,
        *,
        resume_key: Key | None,
        resume_horizon: list[int],
    ) -> None:
        if context.progress.partitions is None:
            raise ValueError("the exact event-time mode keeps progress per partition")
        self.context = context
        self.merge = merge
        self.resume_key = resume_key
        #: per partition, the position's horizon: up to it a record at or below
        #: ``resume_key`` was handed over; past it such a record is a violation
        self.resume_horizon = resume_horizon
        #: a check waiting to be confirmed: (marks, last stored sequences, producers unknown
        #: when it began)
        self._pending: (
            tuple[dict[str, tuple[ProducerMark, int]], dict[int, int], set[str]] | None
        ) = None
        self._last_check = 0.0
        self._held_since: float | None = None

    # -- reading -------------------------------------------------------------------------
    def _needed(self, p: int) -> bool:
        """A pending check needs partition ``p`` read further."""
        pending = self._pending
        return pending is not None and self.context.readers[p].next_seq <= pending[1][p]

    async def fetch(self, p: int) -> None:
        ctx, merge = self.context, self.merge
        reader, space = ctx.readers[p], ctx.space[p]
        assert ctx.progress.partitions is not None
        progress = ctx.progress.partitions[p]
        while not ctx.stopping():
            _cancelled_check()
            if not merge.room(p) and not self._needed(p):
                space.clear()
                await space.wait()
                continue
            try:
                got = await reader.fetch(timeout=1.0)
            except Exception as exc:  # never leave a partition silently unread
                ctx.fail(exc)
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
                    ctx.fail(
                        GlobalOrderViolation(
                            f"partition {p}, stream sequence {seq}: {exc}: the record was not "
                            "published through a GlobalProducer, so it has no place in the "
                            "exact event-time order; the reader stops before it (read such a "
                            "stream without watermarks=True for the window mode)",
                            p,
                        )
                    )
                    return
                resumed = self.resume_key
                if resumed is not None and k <= resumed and seq <= self.resume_horizon[p]:
                    progress.done(seq)  # handed over before the restart (progress)
                    continue
                # past the horizon a key at or below the position's was never handed over:
                # stored after the position was read, it is a violation (merge.add says so)
                size = len(m.data or b"") + sum(len(a) + len(b) for a, b in headers.items())
                try:
                    item = (seq, m, headers, message_key(headers) or "")
                    merge.add(p, k, item, size, f"partition {p}, stream sequence {seq}")
                except NatsOrderedError as exc:  # a violation, or a malformed key header
                    progress.hold(seq)  # not done: the next reader stops at it too
                    ctx.fail(exc)
                    return
            if got:
                ctx.wake.set()

    # -- confirming marks ----------------------------------------------------------------
    async def _check_marks(self) -> None:
        ctx = self.context
        stream = ctx.stream
        self._last_check = time.monotonic()
        unknown = self.merge.unknown()
        js = jetstream(ctx.nc)

        async def last(p: int) -> int:
            try:
                return (await js.get_last_msg(stream.name, stream.subject(p))).seq or 0
            except NotFoundError:
                return 0

        try:
            marks = await read_marks(ctx.nc, stream.name)  # the marks first, then
            lasts = await asyncio.gather(*(last(p) for p in range(stream.partitions)))
        except (NatsError, TimeoutError) as exc:  # tried again at the next poll
            log.info("global-order reader: producer marks not read: %s", exc)
            return
        self._pending = (marks, dict(enumerate(lasts)), unknown)
        for space in ctx.space:  # a full partition the check needs is read on
            space.set()

    def _confirm_marks(self) -> bool | None:
        """Apply the pending check's marks once every partition was read up to its last
        stored sequence: True if applied, None if not yet, False if the reader stops."""
        ctx = self.context
        if self._pending is None or any(self._needed(p) for p in range(len(ctx.readers))):
            return None
        marks, _, unknown = self._pending
        self._pending = None
        stray = sorted(unknown - set(marks))
        if stray:
            name = ctx.stream.name
            ctx.fail(
                GlobalOrderViolation(
                    f"stream {name} has records of producer(s) {', '.join(stray)} "
                    "that never registered (no mark p.<producer> in the bucket "
                    f"nor_{name}_global): publish only through GlobalProducer, "
                    "which registers before it publishes; the reader stops before them",
                    -1,
                )
            )
            return False
        bounds = {p: m.bound() for p, (m, _) in marks.items() if not m.closed}
        closed = {p: m.epoch for p, (m, _) in marks.items() if m.closed}
        before = dict(self.merge.bounds)
        self.merge.set_marks(bounds, closed)
        if self.merge.bounds != before:
            ctx.stats.watermark_advances += 1
        return True

    # -- the merge -------------------------------------------------------------------------
    async def release(self) -> None:
        ctx, merge = self.context, self.merge
        while not ctx.stopping():
            _cancelled_check()
            try:
                popped = merge.pop()
            except GlobalOrderViolation as exc:
                ctx.fail(exc)
                return
            if popped is not None:
                self._held_since = None
                p, k, item = popped
                ctx.space[p].set()
                seq = item[0]
                where = f"{describe_key(k)} (partition {p}, stream sequence {seq})"
                why = " (skipping it would break the order)"
                if not await ctx.hand(p, k[0], item, False, where, why):
                    return
                progress = ctx.progress
                progress.key, progress.g, progress.tie = k, k[0], k[3]
                await ctx.handled(p, seq)
                continue
            await ctx.commit_if_due()
            if merge.buffered() and self._held_since is None:
                self._held_since = time.monotonic()
            confirmed = self._confirm_marks()
            if confirmed is False:
                return
            if confirmed:
                continue
            due = time.monotonic() - self._last_check >= ctx.poll_interval
            if self._pending is None and due:
                await self._check_marks()
                continue
            ctx.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ctx.poll_interval):
                    await ctx.wake.wait()

    def held_back(self) -> tuple[list[str], list[str]]:
        """For the heartbeat: the producers holding the merge back, and the problem to show
        once they have for :data:`HELD_BACK_PROBLEM` seconds."""
        merge = self.merge
        if not merge.buffered():
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
            f"`nats-ordered global-producers --stream {self.context.stream.name} --close {h}`"
            for h in holders
        )
        return holders, [
            f"the merge is held back for {time.monotonic() - since:.0f}s by producer(s) "
            f"{', '.join(marks)}: registered, not closed, no watermark past the next record. "
            f"If it died, restart it with the same producer id, or close it ({close}; in "
            "Python close_producer(nc, stream, producer))"
        ]


__all__ = ["HELD_BACK_PROBLEM", "ProducerStrategy"]
