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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.config import GroupConfig, default_member_id
from airflow_nats_ordered.core.group.global_position import READER_KEY, GlobalPositions
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER
from airflow_nats_ordered.core.order.merge import GlobalMerge, GlobalOrderViolation
from airflow_nats_ordered.core.order.producer_merge import ProducerMerge
from airflow_nats_ordered.core.order.producer_reader import ProducerReading
from airflow_nats_ordered.core.order.producers import Key
from airflow_nats_ordered.core.order.progress import PartitionProgress
from airflow_nats_ordered.core.order.watermarks import (
    HDR_GLOBAL_SEQ,
    parse_global_seq,
    watermark_bucket,
    watermark_of,
)
from airflow_nats_ordered.core.order.window import LATE_POLICIES, WindowMerge
from airflow_nats_ordered.core.order.window_reader import WindowReading
from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.kv import bucket_keys, latest_entry
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


@dataclass
class GlobalReaderStats:
    handled: int = 0
    commits: int = 0
    #: times a partition's bound was raised by its watermark (an idle partition advanced)
    watermark_advances: int = 0
    #: time-window mode: late records met by this reader (flagged, dead-lettered or blocked)
    late: int = 0
    dead_lettered: int = 0
    #: event-time mode: records without a usable time header, set aside (late="dead-letter")
    untimed: int = 0


class GlobalOrderReader(WindowReading, ProducerReading):
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
        self._merge: GlobalMerge
        self._window: WindowMerge | None = None
        self._pmerge: ProducerMerge | None = None
        self._pkey: Key | None = None
        self._resume_pkey: Key | None = None
        self._pending = None
        self._last_check = 0.0
        self._held_since: float | None = None
        self._late: deque[tuple[int, int, Any, str | None]] = deque()
        self._late_total = 0
        self._progress: list[PartitionProgress] | None = None
        self._resume_key = (0, 0)
        self._resume_horizon: list[int] = []
        self._tie = 0
        self._readers: list[PartitionReader] = []
        self._fetchers: list[asyncio.Task[None]] = []
        self._space: list[asyncio.Event] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._store: GroupStore | None = None
        self._started = time.time()
        self._seqs: dict[int, int] = {}
        self._g = 0
        self._token = 0
        self._uncommitted = 0
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
        return self._g

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
        self._g, self._seqs, self._token = pos.g, dict(pos.seqs), pos.token
        self._late_total, self._tie = pos.late, pos.tie
        nparts = self.stream.partitions
        share = max(2, self.max_buffer_bytes // nparts)
        self._merge = GlobalMerge(nparts, after=pos.g, share_bytes=share // 2)
        if self.watermarks:
            key = (pos.g, *pos.producer_key) if pos.producer_key else None
            self._pkey = self._resume_pkey = key
            self._pmerge = ProducerMerge(nparts, key, share // 2)
            # a position written before this mode kept horizons has none: skip by key alone
            read = pos.read or dict.fromkeys(range(nparts) if key else (), 1 << 62)
            self._resume_horizon = [read.get(p, 0) for p in range(nparts)]
            self._progress = [
                PartitionProgress(pos.seqs.get(p, 0), pos.read.get(p, 0)) for p in range(nparts)
            ]
        elif self.order_by != "sequence":
            lateness_ns = int(self.lateness * 1e9)
            self._window = WindowMerge(nparts, lateness_ns, (pos.g, pos.tie), share // 2)
        if self.order_by == "event-time" and not self.watermarks:
            self._resume_key = (pos.g, pos.tie)
            self._resume_horizon = [pos.read.get(p, 0) for p in range(nparts)]
            self._progress = [
                PartitionProgress(pos.seqs.get(p, 0), pos.read.get(p, 0)) for p in range(nparts)
            ]
        self._readers = [
            PartitionReader(
                self.nc,
                self.stream.name,
                self.stream.subject(p),
                self._seqs.get(p, 0) + 1,
                self.fetch_batch,
                lambda: share // 2,
            )
            for p in range(nparts)
        ]
        self._space = [asyncio.Event() for _ in range(nparts)]
        self._last_commit = time.monotonic()
        log.info(
            "global-order reader %s of %s/%s: resuming after global sequence %d (token %d)",
            self.member_id,
            cfg.stream,
            cfg.group,
            pos.g,
            pos.token,
        )

    # -- presence ------------------------------------------------------------------------
    def _info(self) -> bytes:
        problems = (
            [] if self.error is None else [f"global-order reader stopped: {self._error_line()}"]
        )
        holders, held = self._held_back()
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
        fetch = self._fetch if self._window is None else self._fetch_window
        if self._pmerge is not None:
            fetch = self._fetch_producers
        self._fetchers = [asyncio.ensure_future(fetch(p)) for p in range(len(self._readers))]
        self._heartbeat = asyncio.ensure_future(self._beat())
        try:
            if self._pmerge is not None:
                await self._producers_loop()
            elif self._window is None:
                await self._merge_loop()
            else:
                await self._window_loop()
            if self._uncommitted or self.error is not None:
                # a graceful stop or an error: keep what was handled (and say why it stopped)
                await self._commit()
        except Fenced as exc:
            self.error = self.error or exc
            log.error("%s", exc)
        finally:
            for t in self._fetchers:
                t.cancel()
            await asyncio.gather(*self._fetchers, return_exceptions=True)
            for r in self._readers:
                await r.close()
            await self._leave()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            log.error("global-order reader stops: %s", exc)
        self._stopping = True
        self._wake.set()

    # -- reading -------------------------------------------------------------------------
    async def _fetch(self, p: int) -> None:
        reader, merge, space = self._readers[p], self._merge, self._space[p]
        while not self._stopping:
            if not merge.room(p):
                space.clear()
                await space.wait()
                continue
            try:
                got = await reader.fetch(timeout=1.0)
            except Exception as exc:  # never leave a partition silently unread
                self._fail(exc)
                return
            # from here to the end of the loop nothing awaits: what the reader has handed
            # out is in the merge (the watermark check relies on it)
            for seq, m in got:
                headers = dict(m.headers or {})
                g = parse_global_seq(headers.get(HDR_GLOBAL_SEQ))
                if g is None:
                    self._fail(
                        GlobalOrderViolation(
                            f"partition {p}: the record at stream sequence {seq} has no "
                            f"{HDR_GLOBAL_SEQ} header (it was published without "
                            "global_order=True): it has no place in the global order; publish "
                            "to a global-order stream only with global_order=True",
                            p,
                        )
                    )
                    return
                size = len(m.data or b"") + sum(len(k) + len(v) for k, v in headers.items())
                try:
                    key = message_key(headers) or ""
                    merge.add(p, g, (seq, m, headers, key), size)
                except NatsOrderedError as exc:  # a violation, or a malformed key header
                    self._fail(exc)
                    return
            if got:
                self._wake.set()

    async def _watermarks(self, blocking: list[int]) -> None:
        """Raise the bound of each blocking partition whose watermark can be trusted: read
        ``w.<n>``, then the partition's last stored sequence; if the partition was read up
        to it, every record the watermark does not cover is already in the merge."""
        bucket = watermark_bucket(self.stream.name)
        js = self.nc.jetstream()

        async def check(p: int) -> None:
            found = await latest_entry(self.nc, bucket, f"w.{p}")
            w = watermark_of(found[0]) if found else 0
            if w <= self._merge.bound(p):
                return
            try:
                last = (await js.get_last_msg(self.stream.name, self.stream.subject(p))).seq or 0
            except NotFoundError:
                last = 0
            if self._readers[p].next_seq > last and self._merge.advance(p, w):
                self.stats.watermark_advances += 1

        try:
            await asyncio.gather(*(check(p) for p in blocking))
        except (NatsError, TimeoutError) as exc:  # tried again at the next poll
            log.info("global-order reader: watermark check failed: %s", exc)

    # -- the merge -------------------------------------------------------------------------
    async def _merge_loop(self) -> None:
        merge = self._merge
        while not self._stopping:
            try:
                item = merge.pop()
            except GlobalOrderViolation as exc:
                self._fail(exc)
                return
            if item is None:
                await self._commit_if_due()
                blocking = merge.blocking()
                if blocking:
                    await self._watermarks(blocking)
                    if merge.blocking() != blocking or self._stopping:
                        continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval):
                        await self._wake.wait()
                continue
            p, g, record = item
            self._space[p].set()
            msg = self._message(p, g, record, False)
            seq = record[0]
            where = f"global sequence {g} (partition {p}, stream sequence {seq})"
            if not await self._apply(msg, where, " (skipping it would break the order)"):
                return
            self._g = g
            await self._handled(p, seq)

    def _message(self, p: int, t: int, item: Any, late: bool) -> GlobalMessage:
        seq, m, headers, key = item
        return GlobalMessage(t, key, m.data or b"", headers, p, seq, self._token, m.subject, late)

    async def _apply(self, msg: GlobalMessage, where: str, why: str = "") -> bool:
        """Call the handler with ``msg``; on an exception stop the reader before it (it is
        handed over again when the reader starts again) and return False."""
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
        self._done(p, seq)
        self.stats.handled += 1
        self._uncommitted += 1
        if self._uncommitted >= self.commit_every:
            await self._commit()

    def _error_line(self) -> str:
        """Why the reader stopped on its own, one line for the position (``status``)."""
        if self.error is None:
            return ""
        name, text = type(self.error).__name__, self.error_text(self.error).strip()
        line = f"{name}: {text}" if text else name  # TimeoutError() says nothing more
        return line.replace("\r", " ").replace("\n", " ")[:1000]

    async def _commit_if_due(self) -> None:
        if self._uncommitted and time.monotonic() - self._last_commit >= self.commit_interval:
            await self._commit()

    async def _commit(self) -> None:
        try:
            await self._positions.commit(
                self._g,
                self._seqs,
                self._late_total,
                tie=self._tie,
                read=self._horizons(),
                error=self._error_line(),
                producer_key=None if self._pkey is None else self._pkey[1:],
            )
        except Fenced:
            raise
        except (NatsError, TimeoutError) as exc:  # written at the next occasion
            log.warning("global-order reader: position not written: %s", exc)
            return
        self._uncommitted = 0
        self._last_commit = time.monotonic()
        self.stats.commits += 1


__all__ = ["GlobalHandler", "GlobalMessage", "GlobalOrderReader", "GlobalReaderStats"]
