"""One of several producers publishing at the same time into one exact event-time order
(:class:`GlobalProducer`, a wrapper over an :class:`~..publish.publisher.OrderedPublisher`).

Usage (each producer process, its own id)::

    pub = OrderedPublisher(nc, "ORDERS")
    async with GlobalProducer(pub, "billing") as prod:
        await prod.publish(order_id, payload, event_time=when)   # epoch ms or aware datetime

and one reader: ``GlobalOrderReader(nc, "ORDERS", "ledger", handle, order_by="event-time",
watermarks=True)`` (CLI ``global-read --order-by event-time --watermarks``).

Guarantees (the wire parts are in :mod:`.producers`; the proof in
``docs/architecture/order.md``, *Several producers in one exact order*):

* **Per-producer order.** Event times are non-decreasing per producer: a record whose event
  time is below the previous one accepted (or, after a restart with the same id, below the
  last watermark of the earlier instance, or below what :meth:`GlobalProducer.advance`
  promised) is refused with :class:`~..errors.RecordError`
  naming the producer and both times; nothing is sent. Each record gets the headers
  ``Nats-Ordered-Event-Time``, ``Nats-Ordered-Global-Producer`` and
  ``Nats-Ordered-Global-Producer-Seq`` (``<epoch>.<n>``, ``n`` in publish order), so its
  key ``(event time, producer, epoch, n)`` increases in this producer's publish order.
* **Registered before the first record.** :meth:`GlobalProducer.start` writes the
  producer's mark (``p.<producer>``, a new epoch) before anything is published; readers
  wait for every registered producer that is not closed.
* **Watermarks.** Every ``watermark_interval`` seconds (and on :meth:`watermark`) it takes
  W, the key of the last record accepted, then waits until every record accepted up to then
  is acknowledged as stored (per partition, ``pub.stored_positions()``; not a full
  ``pub.flush()``, which under a producer that keeps publishing never finds every lane idle
  at once) and only then writes W: every record of this producer not yet stored has a key
  above W. A failed record writes no watermark again (a record given up on might still be
  stored late; :meth:`publish` raises from then on).
* **Idle.** A producer that publishes nothing writes no new watermark and holds readers
  back (exactness: it might still publish an earlier event time); :meth:`advance` promises
  a time (default now) below which it publishes nothing more, and lets them go on.
* **Closed.** :meth:`close` flushes and closes the publisher, then marks the producer
  ``closed`` (readers stop waiting for it). A failed flush leaves the mark open: the
  readers wait until an operator closes it (:func:`~.producers.close_producer`).
* **One instance per id.** Marks are written by compare-and-set: a producer restarted with
  the same id (or closed by an operator) takes the mark over, and the older instance's
  next watermark or close fails with :class:`~.producers.ProducerFenced`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from nats.nuid import NUID

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError, RecordError
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER
from airflow_nats_ordered.core.order.producers import (
    HDR_PRODUCER_ID,
    HDR_PRODUCER_SEQ,
    MARK_PREFIX,
    Key,
    ProducerFenced,
    ProducerMark,
    check_producer,
    format_event_time,
    show_time,
)
from airflow_nats_ordered.core.order.watermarks import open_watermarks
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.kv import latest_entry

if TYPE_CHECKING:
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_STAMPED = {h.lower() for h in (DEFAULT_TIME_HEADER, HDR_PRODUCER_ID, HDR_PRODUCER_SEQ)}


def event_time_ns(event_time: int | datetime | None, now_ns: int) -> int:
    """``event_time`` in ns since the epoch: an int is Unix epoch **milliseconds** (Kafka's
    record timestamp, >= 0), a datetime must carry a time zone and be at or after the
    epoch, None is ``now_ns``; anything else is a :class:`~..errors.RecordError`."""
    if event_time is None:
        return now_ns
    if isinstance(event_time, datetime):
        if event_time.tzinfo is None:
            raise RecordError(
                f"event_time {event_time.isoformat()} has no time zone: pass an aware "
                "datetime (e.g. tzinfo=UTC) or integer Unix epoch milliseconds"
            )
        if event_time < _EPOCH:  # the header's forms (protocol.md 12.1) cannot carry it
            raise RecordError(
                f"event_time {event_time.isoformat()} is before 1970-01-01T00:00:00Z, which "
                "the event-time header cannot carry: pass a time at or after the Unix epoch"
            )
        return (event_time - _EPOCH) // timedelta(microseconds=1) * 1000
    if isinstance(event_time, int) and not isinstance(event_time, bool) and event_time >= 0:
        return event_time * 1_000_000
    raise RecordError(
        f"event_time must be integer Unix epoch milliseconds (>= 0) or an aware datetime, "
        f"got {event_time!r}"
    )


class GlobalProducer:
    """Publishes through ``pub`` (not started yet, or started; without ``global_order``) as
    producer ``producer`` of the stream's exact event-time order. It owns ``pub``:
    :meth:`close` closes it."""

    def __init__(
        self, pub: OrderedPublisher, producer: str, *, watermark_interval: float = 0.2
    ) -> None:
        self.producer = check_producer(producer)
        if pub.config.global_order:
            raise ConfigError(
                "GlobalProducer needs an OrderedPublisher without global_order (that is the "
                "single-sequencer mode); pass OrderedPublisher(nc, stream) as pub"
            )
        if float(watermark_interval) <= 0:
            raise ConfigError(f"watermark_interval must be > 0 seconds, got {watermark_interval!r}")
        self.pub = pub
        self.watermark_interval = float(watermark_interval)
        self.epoch = 0
        self.instance = NUID().next().decode()
        self._kv: KeyValue
        self._revision = 0
        #: no event time below it is accepted: the earlier instance's watermark (restart),
        #: or what :meth:`advance` promised; ``_floor_what`` says which
        self._floor = 0
        self._floor_what = "the last watermark of its earlier instance (same producer id)"
        self._last_e: int | None = None  # the event time of the last record accepted
        self._n = 0  # the counter of the last record accepted
        #: per partition, the position (in ``pub.stored_positions()``'s count) of the last
        #: record accepted through this producer
        self._positions: dict[int, int] = {}
        #: the last watermark written, as a key (None: none yet)
        self.watermarked: Key | None = None
        self._written: tuple[int | None, int] = (None, 0)
        self._error: BaseException | None = None
        self._closed = False
        self._lock = asyncio.Lock()  # key taken and record accepted in one step
        self._mark_lock = asyncio.Lock()  # one mark write at a time: they never go down
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> GlobalProducer:
        await self.start()
        return self

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        await self.close()

    @property
    def last_key(self) -> Key | None:
        """The key of the last record accepted (None: none yet)."""
        e = self._last_e
        return None if e is None else (e, self.producer, self.epoch, self._n)

    async def start(self) -> None:
        """Start the publisher if needed and register the producer (a new epoch). After a
        restart with the same id the earlier instance's watermark stays the floor: event
        times below it are refused."""
        if not getattr(self.pub, "_started", False):
            await self.pub.start()
        if self.pub.accepted:
            raise ConfigError(
                "GlobalProducer needs a publisher that has published nothing yet (its records "
                "would have no place in the order): pass a new OrderedPublisher"
            )
        self._positions = dict(self.pub.stored_positions())
        self._kv = await open_watermarks(self.pub.nc, self.pub.stream)
        bucket, key = watermark_bucket(self.pub.stream.name), MARK_PREFIX + self.producer
        while True:
            entry = await latest_entry(self.pub.nc, bucket, key)
            old = ProducerMark.from_json(entry[0]) if entry and entry[0] else None
            epoch = (old.epoch if old else 0) + 1
            e = old.e if old else None
            # n=0: every record of the new epoch (n >= 1, event time >= e) is above it
            mark = ProducerMark(self.producer, epoch, "open", e, 0, self.instance)
            try:
                if entry is None:
                    self._revision = await self._kv.create(key, mark.to_json())
                else:
                    self._revision = await self._kv.update(key, mark.to_json(), last=entry[1])
            except KeyWrongLastSequenceError:
                continue
            break
        self.epoch, self._floor = epoch, e or 0
        log.info("global producer %s: registered, epoch %d", self.producer, epoch)
        self._task = asyncio.ensure_future(self._loop())

    async def publish(
        self,
        key: str | bytes | None,
        data: bytes,
        *,
        event_time: int | datetime | None = None,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
    ) -> int:
        """Stamp and queue one record (``event_time``: epoch ms, aware datetime, or None for
        now); returns its partition. Refuses an event time below this producer's previous
        one (:class:`~..errors.RecordError`, nothing sent)."""
        if self._error is not None:
            raise RecordError(
                f"producer {self.producer} publishes no more records: {self._error}"
            ) from self._error
        if self._closed or not self.epoch:
            raise RuntimeError(f"producer {self.producer} is not started, or closed")
        if headers and any(h.lower() in _STAMPED for h in headers):
            raise RecordError(
                f"headers {', '.join(sorted(headers))}: {DEFAULT_TIME_HEADER}, "
                f"{HDR_PRODUCER_ID} and {HDR_PRODUCER_SEQ} are set by the producer; remove "
                "them (pass the event time as event_time)"
            )
        async with self._lock:
            e = event_time_ns(event_time, time.time_ns())
            self._check_time(e)
            n = self._n + 1
            stamped = dict(headers or {})
            stamped[DEFAULT_TIME_HEADER] = format_event_time(e)
            stamped[HDR_PRODUCER_ID] = self.producer
            stamped[HDR_PRODUCER_SEQ] = f"{self.epoch}.{n}"
            before, accepted = (self._last_e, self._n), self.pub.accepted
            self._last_e, self._n = e, n
            try:
                part = await self.pub.publish(key, data, headers=stamped, msg_id=msg_id)
            except BaseException:
                if self.pub.accepted == accepted:
                    self._last_e, self._n = before  # refused: nothing was accepted
                else:  # cancelled after it was accepted: its partition is not known here
                    self._error = NatsOrderedError(
                        "a publish was cancelled after its record was accepted, so no "
                        "watermark can say it is stored; start a new producer instance"
                    )
                raise
            self._positions[part] = self._positions.get(part, 0) + 1
            return part

    async def _stored(self, upto: dict[int, int]) -> None:
        """Until every partition's records up to position ``upto[p]`` are acknowledged as
        stored (acknowledgements come in order per partition). Not ``pub.flush()``: under a
        producer that keeps publishing, its lanes are never all idle at once, and no
        watermark was written for as long as it kept publishing. A failed record raises
        :class:`~..publish.summary.PublishError` (through ``flush``) and no watermark is
        written again."""
        while True:
            if self.pub.failed:
                try:
                    await self.pub.flush()
                except PublishError as exc:
                    self._error = exc
                    raise
            stored = self.pub.stored_positions()
            if all(stored.get(p, 0) >= n for p, n in upto.items()):
                return
            await asyncio.sleep(0.005)

    def _check_time(self, e: int) -> None:
        last = self._last_e
        if last is not None and last >= self._floor:
            prev, what = last, "its previous record's event time"
        else:
            prev, what = self._floor, self._floor_what
        if e < prev:
            raise RecordError(
                f"producer {self.producer}: event time {show_time(e)} is below {what} "
                f"{show_time(prev)}: a producer's event times must not decrease (that is what "
                "lets readers merge producers exactly). Publish it from another producer id, "
                "or with an event time at or after that one"
            )

    def _mark_time(self) -> int | None:
        """The event time a watermark may promise now: the last accepted, or the floor."""
        if self._last_e is None:
            return self._floor or None
        return max(self._last_e, self._floor)

    async def advance(self, event_time: int | datetime | None = None) -> Key:
        """Promise that no record of this producer below ``event_time`` (epoch ms, aware
        datetime; None: now) follows, so that an idle producer does not hold readers back;
        from then on such an event time is refused. Writes the watermark once everything
        accepted before is stored."""
        async with self._mark_lock:
            if self._error is not None:
                raise self._error
            async with self._lock:
                e = event_time_ns(event_time, time.time_ns())
                self._check_time(e)
                self._floor, self._floor_what = e, "the time it advanced to (advance())"
                w, upto = (e, self._n), dict(self._positions)
            await self._stored(upto)
            await self._write(ProducerMark(self.producer, self.epoch, "open", w[0], w[1]))
            self._written = w
            self.watermarked = (w[0], self.producer, self.epoch, w[1])
            return self.watermarked

    async def watermark(self) -> Key | None:
        """Write a watermark now (if a record was accepted since the last one): take W, wait
        until the records up to it are stored, write W. Returns the key written (None:
        nothing new). Raises :class:`~..publish.summary.PublishError` (no watermark again)
        or :class:`~.producers.ProducerFenced`."""
        async with self._mark_lock:
            if self._error is not None:
                raise self._error
            async with self._lock:
                w, upto = (self._mark_time(), self._n), dict(self._positions)
            if w == self._written or w[0] is None:
                return None
            await self._stored(upto)
            await self._write(ProducerMark(self.producer, self.epoch, "open", w[0], w[1]))
            self._written = w
            self.watermarked = (w[0], self.producer, self.epoch, w[1])
            return self.watermarked

    async def close(self) -> None:
        """Flush and close the publisher, then mark the producer closed. A failed flush
        raises :class:`~..publish.summary.PublishError` and leaves the mark open."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        async with self._mark_lock:
            async with self._lock:
                e, n = self._mark_time(), self._n
            await self.pub.close()
            if self._error is not None or not self.epoch:
                if isinstance(self._error, ProducerFenced):
                    raise self._error
                return
            await self._write(ProducerMark(self.producer, self.epoch, "closed", e, n))
        log.info("global producer %s: closed", self.producer)

    async def _write(self, mark: ProducerMark) -> None:
        mark = ProducerMark(mark.producer, mark.epoch, mark.state, mark.e, mark.n, self.instance)
        try:
            rev = await self._kv.update(MARK_PREFIX + self.producer, mark.to_json(), self._revision)
        except KeyWrongLastSequenceError:
            self._error = ProducerFenced(
                f"producer {self.producer} of stream {self.pub.stream.name}: its mark was taken "
                "over (an instance with the same producer id started, or an operator closed "
                "it): this instance writes no more watermarks and publishes nothing more"
            )
            raise self._error from None
        self._revision = rev

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.watermark_interval)
            try:
                await self.watermark()
            except asyncio.CancelledError:
                raise
            except (NatsError, TimeoutError) as exc:  # written at the next round
                log.info("global producer %s: watermark not written: %s", self.producer, exc)
            except Exception as exc:  # failed or fenced: no watermark ever again
                log.error("global producer %s: no more watermarks: %s", self.producer, exc)
                return


__all__ = ["GlobalProducer", "event_time_ns"]
