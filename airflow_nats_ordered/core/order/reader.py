"""The global-order reader (:class:`GlobalOrderReader`): every partition merged into one total
order by ``Nats-Global-Seq``, handed to one handler, with a durable position.

Usage::

    async def handle(msg: GlobalMessage) -> None:
        ledger.apply(msg.global_seq, msg.key, msg.data)

    reader = GlobalOrderReader(nc, "ORDERS", "ledger", handle)
    await reader.start()
    ...
    await reader.stop()        # finishes the record in hand and writes the position

Guarantees (design and proof: ``docs/architecture/order.md``, *Global order*):

* **Exact total order.** The handler gets records in strictly increasing global sequence,
  and a record only once nothing smaller can still arrive on any partition (its buffer or
  its watermark says so, :mod:`.merge`). Nothing is skipped: every record of every
  partition with a global sequence above the position is handed over, in that order.
* **Stops rather than reorders.** A record without a global sequence, or one that breaks
  the order (two publishers at once, a broken watermark), stops the reader before it
  (``error`` is a :class:`~.merge.GlobalOrderViolation`); so does a handler that
  raises. What was handled before is committed.
* **Durable position, at least once after a crash.** The position (:mod:`..group.global_position`)
  is written every ``commit_every`` records, every ``commit_interval`` seconds and on
  :meth:`GlobalOrderReader.stop`; after a crash the records after the last written
  position are handed over again, in the same order. A handler that ignores a
  ``global_seq`` at or below the last one it applied gets each record exactly once.
* **Fenced.** Starting takes the position with a new fencing token; a reader whose
  position was taken over by a newer one stops at its next write (``error`` is
  :class:`~..group.commits.Fenced`). The token reaches the handler (``fencing_token``).
* **Bounded memory, in bytes.** At most about ``max_buffer_bytes`` of read, not yet handled
  records are held: each partition gets an equal share, half for its reader (buffered and
  requested) and half for its merge buffer, which is not read further while full
  (back-pressure per partition). A single larger record is still read, alone.

The reader *has* a merge strategy, one per mode (:mod:`.strategy`): it checks its knobs,
takes the position, builds the partitions' readers and the strategy, runs the strategy,
calls the handler for it, writes the position and keeps the heartbeat.
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError, PermissionDenied
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.config import GroupConfig, default_member_id
from airflow_nats_ordered.core.group.global_position import (
    READER_KEY,
    GlobalPosition,
    GlobalPositions,
)
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER
from airflow_nats_ordered.core.order.late import DeadLetters
from airflow_nats_ordered.core.order.merge import GlobalMerge
from airflow_nats_ordered.core.order.producer_merge import ProducerMerge
from airflow_nats_ordered.core.order.producer_reader import ProducerStrategy
from airflow_nats_ordered.core.order.progress import ReaderProgress
from airflow_nats_ordered.core.order.sequence_reader import SequenceStrategy
from airflow_nats_ordered.core.order.strategy import (
    GlobalReaderStats,
    MergeStrategy,
    ReadingContext,
)
from airflow_nats_ordered.core.order.window import LATE_POLICIES, WindowMerge
from airflow_nats_ordered.core.order.window_reader import WindowStrategy
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.kv import bucket_keys
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.stream.reader import PartitionReader

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GlobalMessage:
    """What the handler of a :class:`GlobalOrderReader` receives: a record and its place in
    the global order (``global_seq``) and in its partition (``partition``, ``stream_seq``)."""

    global_seq: int
    key: str
    data: bytes
    headers: dict[str, str]
    partition: int
    stream_seq: int
    fencing_token: int
    subject: str
    #: time-window mode, ``late="flag"``: the record came after later ones were handed over
    late: bool = False


GlobalHandler = Callable[[GlobalMessage], Any]


class GlobalOrderReader:
    """Reads every partition of ``stream`` and hands ``handler`` (sync or async) one total
    order; the group ``group`` holds its position. Knobs: ``commit_every`` records,
    ``commit_interval`` seconds, ``max_buffer_bytes`` (whole reader), ``fetch_batch``
    records per pull request, ``poll_interval`` seconds between watermark checks of a
    partition that holds the merge back, ``member_id`` (who writes the position).

    ``order_by="time"`` is the time-window mode for records without ``Nats-Global-Seq``
    (foreign producers, no watermarks): records are ordered by the time the server stored
    them (ties: stream sequence) and released ``lateness`` seconds after that time once
    every partition has been read that far (:mod:`.window`); a record that comes
    after later ones were released is *late*: ``late="block"`` (default) stops the reader
    before it, ``"dead-letter"`` sets it aside on ``<prefix>.dlq.<group>.<partition>`` (as
    a worker's poison policy does) and ``"flag"`` hands it over at once with
    ``msg.late=True``. Late records are counted in ``stats.late`` and in the position
    (``status`` shows them).

    ``order_by="event-time"`` orders the same way by the producer's event time instead:
    the header ``time_header`` (default ``Nats-Ordered-Event-Time``; integer Unix epoch
    milliseconds or RFC 3339, :mod:`.event_time`), ties broken by stream sequence.
    Several producers (foreign clients too) share one order; a record is late only if it
    was stored, or reached the reader, more than ``lateness`` after its event time. A record
    whose header is missing or not a time is set aside with ``late="dead-letter"``, and
    stops the reader before it otherwise (:class:`~.event_time.EventTimeError`).
    ``msg.global_seq`` is the event time in ns.

    ``order_by="event-time", watermarks=True`` is the exact event-time mode for records of
    several :class:`~.producer.GlobalProducer` instances publishing at once: ordered
    by ``(event time, producer, epoch, n)`` with no window, a record handed over once every
    registered producer that is not closed has a watermark at or above it
    (:mod:`.producer_reader`); a silent producer holds the merge back (the heartbeat
    names it). ``lateness``, ``late`` and ``time_header`` do not apply to it.

    A reader that stops on its own writes why into its position (``error``): ``status``
    shows it until a reader of the group starts again."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        group: str,
        handler: GlobalHandler,
        *,
        commit_every: int = 500,
        commit_interval: float = 1.0,
        max_buffer_bytes: int = 64 * 1024 * 1024,
        fetch_batch: int = 500,
        poll_interval: float = 0.1,
        member_id: str | None = None,
        order_by: str = "sequence",
        lateness: float | None = None,
        late: str | None = None,
        time_header: str | None = None,
        watermarks: bool = False,
    ) -> None:
        if order_by not in ("sequence", "time", "event-time"):
            raise ConfigError(
                f"order_by must be 'sequence', 'time' or 'event-time', got {order_by!r}"
            )
        if watermarks and order_by != "event-time":
            raise ConfigError(
                f"watermarks=True is the exact event-time mode: pass order_by='event-time' "
                f"with it (got order_by={order_by!r})"
            )
        window_args = (("lateness", lateness), ("late", late), ("time_header", time_header))
        for name, arg in window_args if watermarks else ():
            if arg is not None:
                raise ConfigError(
                    f"{name} applies to the window modes; the exact event-time mode "
                    f"(watermarks=True) has no window and reads {DEFAULT_TIME_HEADER}: leave "
                    f"{name} out, or leave watermarks out for the window mode"
                )
        self.watermarks = bool(watermarks)
        lateness = 2.0 if lateness is None else lateness
        late = "block" if late is None else late
        if time_header is not None and order_by != "event-time":
            raise ConfigError(
                "time_header applies to order_by='event-time'; pass both, or no time_header"
            )
        header = DEFAULT_TIME_HEADER if time_header is None else time_header
        if not header or not header.isascii() or not header.isprintable() or ":" in header:
            raise ConfigError(f"time_header must be a header name, got {time_header!r}")
        if " " in header:
            raise ConfigError(f"time_header must be a header name, got {time_header!r}")
        self.time_header = header
        if late not in LATE_POLICIES:
            raise ConfigError(f"late must be one of {', '.join(LATE_POLICIES)}, got {late!r}")
        if float(lateness) <= 0:
            raise ConfigError(f"lateness must be > 0 seconds, got {lateness!r}")
        self.order_by = order_by
        self.lateness = float(lateness)
        self.late = late
        for name, value in (
            ("commit_every", commit_every),
            ("max_buffer_bytes", max_buffer_bytes),
            ("fetch_batch", fetch_batch),
        ):
            if int(value) < 1:
                raise ConfigError(f"{name} must be >= 1, got {value!r}")
        intervals = (("commit_interval", commit_interval), ("poll_interval", poll_interval))
        for name, fvalue in intervals:
            if float(fvalue) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {fvalue!r}")
        self.nc = nc
        self.group_config = GroupConfig(stream, group)  # checks the group name
        self.handler = handler
        self.commit_every = commit_every
        self.commit_interval = commit_interval
        self.max_buffer_bytes = max_buffer_bytes
        self.fetch_batch = fetch_batch
        self.poll_interval = poll_interval
        self.member_id = member_id or default_member_id()
        self.stats = GlobalReaderStats()
        #: why the reader stopped on its own (a violation, a handler error, Fenced), or None
        self.error: BaseException | None = None
        #: how :attr:`error` is worded in the position (``status`` shows it): an interface
        #: other than Python sets its own terms (the CLI names its flags); default ``str``
        self.error_text: Callable[[BaseException], str] = str
        self.stream: PartitionedStream
        self._positions: GlobalPositions
        #: how the partitions are merged, one per mode (set when the position is taken)
        self._strategy: MergeStrategy | None = None
        #: what is done, as the position records it (the strategy moves it)
        self._progress = ReaderProgress()
        self._readers: list[PartitionReader] = []
        self._fetchers: list[asyncio.Task[None]] = []
        self._space: list[asyncio.Event] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._store: GroupStore | None = None
        self._started = time.time()
        self._token = 0
        self._last_commit = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Take the position and run in the background until :meth:`stop` (or an error)."""
        await self.open()
        self._task = asyncio.ensure_future(self._run())

    async def run(self) -> None:
        """Take the position and run in this task until :meth:`stop` or an error (raised).
        Cancelling this task is a crash: nothing more is committed."""
        await self.open()
        await self._run()
        if self.error is not None:
            raise self.error

    async def wait(self) -> None:
        """Until the reader stopped; raises the error that stopped it, if any."""
        if self._task is not None:
            await asyncio.shield(self._task)
        if self.error is not None:
            raise self.error

    async def stop(self) -> None:
        """Finish the record in hand, write the position and stop reading."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def position(self) -> int:
        """The last global sequence handed to the handler (0: none)."""
        return self._progress.g

    @property
    def _pmerge(self) -> ProducerMerge | None:
        """The exact event-time mode's merge, else None (tests look inside it)."""
        strategy = self._strategy
        return strategy.merge if isinstance(strategy, ProducerStrategy) else None

    async def open(self) -> None:
        """Take the group's position (a new fencing token); :meth:`start` calls it."""
        cfg = self.group_config
        if await bucket_keys(self.nc, cfg.state_bucket, "c."):
            raise ConfigError(
                f"group {cfg.group} of stream {cfg.stream} is a consumer group of per-key "
                "workers (it has partition commit records): a global-order reader keeps its "
                "own position, so give it a group of its own (another group name)"
            )
        store = await GroupStore.open(self.nc, cfg)
        assert store.stream is not None
        self._store = store
        self.stream = store.stream
        self._positions = GlobalPositions(
            self.nc, store.state, cfg.state_bucket, cfg.stream, cfg.group, self.stream.created
        )
        order = "event-time-exact" if self.watermarks else self.order_by
        pos = await self._positions.grant(self.member_id, order)
        if pos.order != order:
            raise ConfigError(
                f"group {cfg.group} of stream {cfg.stream} holds a position ordered by "
                f"{pos.order!r}; this reader was given order_by={self.order_by!r}"
                f"{', watermarks=True' if self.watermarks else ''}: the two do "
                "not resume each other, so use another group"
            )
        self._token = pos.token
        nparts = self.stream.partitions
        share = max(2, self.max_buffer_bytes // nparts)
        per_partition = self.order_by == "event-time"  # records go out of stream order
        self._progress = ReaderProgress.resumed(pos, nparts, per_partition)
        self._readers = [
            PartitionReader(
                self.nc,
                self.stream.name,
                self.stream.subject(p),
                self._progress.seqs.get(p, 0) + 1,
                self.fetch_batch,
                lambda: share // 2,
            )
            for p in range(nparts)
        ]
        self._space = [asyncio.Event() for _ in range(nparts)]
        self._strategy = self._strategy_for(pos, share // 2)
        self._last_commit = time.monotonic()
        log.info(
            "global-order reader %s of %s/%s: resuming after global sequence %d (token %d)",
            self.member_id,
            cfg.stream,
            cfg.group,
            pos.g,
            pos.token,
        )

    def _strategy_for(self, pos: GlobalPosition, share: int) -> MergeStrategy:
        """The merge strategy of this reader's mode, resumed at ``pos``; ``share``: the bytes
        each partition's buffer in the merge holds."""
        context = ReadingContext(
            self.nc,
            self.stream,
            self._readers,
            self._space,
            self._wake,
            self.poll_interval,
            self.stats,
            self._progress,
            stopping=self._is_stopping,
            fail=self._fail,
            hand=self._hand,
            handled=self._handled,
            commit_if_due=self._commit_if_due,
        )
        nparts = self.stream.partitions
        if self.watermarks:
            key = self._progress.key
            # a position written before this mode kept horizons has none: skip by key alone
            read = pos.read or dict.fromkeys(range(nparts) if key else (), 1 << 62)
            return ProducerStrategy(
                context,
                ProducerMerge(nparts, key, share),
                resume_key=key,
                resume_horizon=[read.get(p, 0) for p in range(nparts)],
            )
        if self.order_by == "sequence":
            return SequenceStrategy(context, GlobalMerge(nparts, after=pos.g, share_bytes=share))
        lateness_ns = int(self.lateness * 1e9)
        event_time = self.order_by == "event-time"
        return WindowStrategy(
            context,
            WindowMerge(nparts, lateness_ns, (pos.g, pos.tie), share),
            lateness=self.lateness,
            late=self.late,
            dead_letters=DeadLetters(self.nc, self.stream, self.group_config, self._token),
            time_header=self.time_header if event_time else None,
            resume_key=(pos.g, pos.tie),
            resume_horizon=[pos.read.get(p, 0) for p in range(nparts)] if event_time else [],
        )

    # -- presence ------------------------------------------------------------------------
    def _info(self) -> bytes:
        problems = (
            [] if self.error is None else [f"global-order reader stopped: {self._error_line()}"]
        )
        holders, held = ([], []) if self._strategy is None else self._strategy.held_back()
        return json.dumps(
            {
                "member": self.member_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": self._started,
                "ts": round(time.time(), 3),
                "global_order": True,
                "held_back_by": holders,
                "problems": problems + held,
            }
        ).encode()

    async def _beat(self) -> None:
        """Key ``global`` of the lease bucket, every quarter of its TTL: ``status`` shows the
        reader as the group's member and drains see it alive; the TTL removes it when the
        process dies."""
        assert self._store is not None
        every = self._store.cfg.lease_ttl / 4
        while True:
            try:
                await self._store.leases.put(READER_KEY, self._info())
            except (NatsError, TimeoutError) as exc:  # tried again at the next beat
                log.info("global-order reader: heartbeat not written: %s", exc)
            await asyncio.sleep(every)

    async def _leave(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
        if self._store is not None:
            with contextlib.suppress(NatsError, TimeoutError, NotFoundError):
                await self._store.leases.delete(READER_KEY)

    async def _run(self) -> None:
        strategy = self._strategy
        assert strategy is not None  # open() sets it
        fetchers = (strategy.fetch(p) for p in range(len(self._readers)))
        self._fetchers = [asyncio.ensure_future(f) for f in fetchers]
        self._heartbeat = asyncio.ensure_future(self._beat())
        # a refused permission stops the reader, naming it (a retry is refused the same way)
        unwatch = denials.watch(self.nc, self._refused)
        try:
            await strategy.release()
            if self._progress.unwritten or self.error is not None:
                # a graceful stop or an error: keep what was handled (and say why it stopped)
                await self._commit()
        except Fenced as exc:
            self.error = self.error or exc
            log.error("%s", exc)
        finally:
            unwatch()
            for t in self._fetchers:
                t.cancel()
            await asyncio.gather(*self._fetchers, return_exceptions=True)
            for r in self._readers:
                await r.close()
            await self._leave()

    def _refused(self, error: PermissionDenied) -> None:
        """Stop on a refusal of one of the reader's own operations (its stream, its group's
        buckets, the watermarks, its dead letters, its reply inboxes); a refusal of another
        part of a program sharing the connection is not the reader's."""
        cfg = self.group_config
        names = cfg.jetstream_names(watermark_bucket(cfg.stream))
        prefixes = (f"{self.stream.prefix}.dlq.{cfg.group}",)
        if denials.concerns(self.nc, error, names=names, prefixes=prefixes):
            self._fail(error)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            log.error("global-order reader stops: %s", exc)
        self._stopping = True
        self._wake.set()

    def _is_stopping(self) -> bool:
        return self._stopping

    # -- handing over ----------------------------------------------------------------------
    async def _hand(self, p: int, t: int, item: Any, late: bool, where: str, why: str) -> bool:
        """Call the handler with the record ``item`` ``(seq, msg, headers, key)`` of partition
        ``p`` at ``t``; on an exception stop the reader before it (it is handed over again
        when the reader starts again) and return False."""
        seq, m, headers, key = item
        msg = GlobalMessage(t, key, m.data or b"", headers, p, seq, self._token, m.subject, late)
        try:
            result = self.handler(msg)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(
                NatsOrderedError(
                    f"the handler raised on {where}: {exc!r}; the reader stops before it"
                    f"{why} and resumes with it when started again"
                )
            )
            return False
        return True

    async def _handled(self, p: int, seq: int) -> None:
        """Count a handled record of partition ``p`` and commit every ``commit_every``."""
        self._progress.done(p, seq)
        self.stats.handled += 1
        self._progress.unwritten += 1
        if self._progress.unwritten >= self.commit_every:
            await self._commit()

    def _error_line(self) -> str:
        """Why the reader stopped on its own, one line for the position (``status``)."""
        if self.error is None:
            return ""
        name, text = type(self.error).__name__, self.error_text(self.error).strip()
        line = f"{name}: {text}" if text else name  # TimeoutError() says nothing more
        return line.replace("\r", " ").replace("\n", " ")[:1000]

    async def _commit_if_due(self) -> None:
        if (
            self._progress.unwritten
            and time.monotonic() - self._last_commit >= self.commit_interval
        ):
            await self._commit()

    async def _commit(self) -> None:
        progress = self._progress
        try:
            await self._positions.commit(
                progress.g,
                progress.seqs,
                progress.late,
                tie=progress.tie,
                read=progress.horizons(),
                error=self._error_line(),
                producer_key=None if progress.key is None else progress.key[1:],
            )
        except Fenced:
            raise
        except (NatsError, TimeoutError) as exc:  # written at the next occasion
            log.warning("global-order reader: position not written: %s", exc)
            return
        progress.unwritten = 0
        self._last_commit = time.monotonic()
        self.stats.commits += 1


__all__ = ["GlobalHandler", "GlobalMessage", "GlobalOrderReader"]
