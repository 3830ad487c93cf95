"""The global-order reader's sequence mode (:class:`SequenceStrategy`, ``order_by="sequence"``,
the default): every partition merged by ``Nats-Global-Seq`` into one exact order.

Records are read into the :class:`~.merge.GlobalMerge`, which hands a record over only once
nothing smaller can still arrive on any partition. A partition with nothing buffered holds
the merge back until its watermark (``w.<n>``, written by the global-order publisher,
:mod:`.watermarks`) can be trusted: the reader reads the watermark, *then* the partition's
last stored sequence, and raises the partition's bound to the watermark once it has read the
partition up to that sequence (every record the watermark does not cover is then in the
merge).

Guarantees: records are handed over in strictly increasing global sequence, each once (at
least once after a crash); a record without a global sequence, or one that breaks the order
(two publishers at once, a broken watermark), stops the reader before it
(:class:`~.merge.GlobalOrderViolation`), and so does a handler that raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.order.merge import GlobalMerge, GlobalOrderViolation
from airflow_nats_ordered.core.order.strategy import ReadingContext
from airflow_nats_ordered.core.order.watermarks import (
    HDR_GLOBAL_SEQ,
    parse_global_seq,
    watermark_of,
)
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.kv import latest_entry

log = logging.getLogger(__name__)


class SequenceStrategy:
    """Merges by global sequence with ``merge`` (resumed after the position's ``g``)."""

    def __init__(self, context: ReadingContext, merge: GlobalMerge) -> None:
        self.context = context
        self.merge = merge

    # -- reading -------------------------------------------------------------------------
    async def fetch(self, p: int) -> None:
        ctx, merge = self.context, self.merge
        reader, space = ctx.readers[p], ctx.space[p]
        while not ctx.stopping():
            if not merge.room(p):
                space.clear()
                await space.wait()
                continue
            try:
                got = await reader.fetch(timeout=1.0)
            except Exception as exc:  # never leave a partition silently unread
                ctx.fail(exc)
                return
            # from here to the end of the loop nothing awaits: what the reader has handed
            # out is in the merge (the watermark check relies on it)
            for seq, m in got:
                headers = dict(m.headers or {})
                g = parse_global_seq(headers.get(HDR_GLOBAL_SEQ))
                if g is None:
                    ctx.fail(
                        GlobalOrderViolation(
                            f"partition {p}: the record at stream sequence {seq} has no "
                            f"{HDR_GLOBAL_SEQ} header (it was published without global "
                            "order): it has no place in the global order; publish to a "
                            "global-order stream only in global order "
                            "(PublisherConfig(global_order=GlobalOrder()), publish "
                            "--global-order, the operator's or Spark's global_order=True)",
                            p,
                        )
                    )
                    return
                size = len(m.data or b"") + sum(len(k) + len(v) for k, v in headers.items())
                try:
                    key = message_key(headers) or ""
                    merge.add(p, g, (seq, m, headers, key), size)
                except NatsOrderedError as exc:  # a violation, or a malformed key header
                    ctx.fail(exc)
                    return
            if got:
                ctx.wake.set()

    async def _watermarks(self, blocking: list[int]) -> None:
        """Raise the bound of each blocking partition whose watermark can be trusted: read
        ``w.<n>``, then the partition's last stored sequence; if the partition was read up
        to it, every record the watermark does not cover is already in the merge."""
        ctx = self.context
        stream = ctx.stream
        bucket = watermark_bucket(stream.name)
        js = jetstream(ctx.nc)

        async def check(p: int) -> None:
            found = await latest_entry(ctx.nc, bucket, f"w.{p}")
            w = watermark_of(found[0]) if found else 0
            if w <= self.merge.bound(p):
                return
            try:
                last = (await js.get_last_msg(stream.name, stream.subject(p))).seq or 0
            except NotFoundError:
                last = 0
            if ctx.readers[p].next_seq > last and self.merge.advance(p, w):
                ctx.stats.watermark_advances += 1

        try:
            await asyncio.gather(*(check(p) for p in blocking))
        except (NatsError, TimeoutError) as exc:  # tried again at the next poll
            log.info("global-order reader: watermark check failed: %s", exc)

    # -- the merge -------------------------------------------------------------------------
    async def release(self) -> None:
        ctx, merge = self.context, self.merge
        while not ctx.stopping():
            try:
                item = merge.pop()
            except GlobalOrderViolation as exc:
                ctx.fail(exc)
                return
            if item is None:
                await ctx.commit_if_due()
                blocking = merge.blocking()
                if blocking:
                    await self._watermarks(blocking)
                    if merge.blocking() != blocking or ctx.stopping():
                        continue
                ctx.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ctx.poll_interval):
                        await ctx.wake.wait()
                continue
            p, g, record = item
            ctx.space[p].set()
            seq = record[0]
            where = f"global sequence {g} (partition {p}, stream sequence {seq})"
            why = " (skipping it would break the order)"
            if not await ctx.hand(p, g, record, False, where, why):
                return
            ctx.progress.g = g
            await ctx.handled(p, seq)

    def held_back(self) -> tuple[list[str], list[str]]:
        return [], []  # only the exact event-time mode names what holds its merge back


__all__ = ["SequenceStrategy"]
