"""The global sequence's wire parts: the ``Nats-Global-Seq`` header, the watermark bucket
``nor_<stream>_global`` and the publisher's watermark writer (:class:`WatermarkWriter`).

Global order builds on the publisher: :class:`GlobalOrder` is the stream-wide sequence
(:class:`~..publish.sequence.StreamSequence`) a caller hands the publisher
(``PublisherConfig(global_order=GlobalOrder())``); the publisher stamps it and reports its
idle points, and never imports this module. :func:`~..stream.repartition.repartition`
refuses a stream published in global order by its watermark bucket, named in
:mod:`..stream.buckets`.

Guarantees (the promise a watermark makes, and why it holds, is in ``docs/architecture/order.md``,
*Global order*; the wire format in ``docs/protocol.md`` section 12):

* :func:`global_base` is above every global sequence stored on the stream or promised by a
  watermark, so a publisher that starts after another one ends extends its order.
* :class:`WatermarkWriter` writes ``w.<n> = W`` only in a synchronous step that saw
  partition n's lane idle (nothing queued, nothing awaiting its acknowledgement, no
  failure) and read ``W`` as the publisher's next global sequence: every record of n with
  a smaller one is stored before the watermark is, and every later one gets ``W`` or more.
  A watermark never goes down within one publisher, and a lane that failed writes none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.order.sequencer import SequencerClaim
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.kv import bucket_keys, compact_json, latest_entry
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream

log = logging.getLogger(__name__)

#: the header carrying a record's global sequence (decimal, >= 1)
HDR_GLOBAL_SEQ = "Nats-Global-Seq"


def parse_global_seq(value: str | None) -> int | None:
    """A ``Nats-Global-Seq`` value as an int >= 1, or None if missing or not one."""
    if value and value.isascii() and value.isdigit() and value[0] != "0":
        return int(value)
    return None


def watermark_of(data: bytes | None) -> int:
    """The ``g`` of a watermark record (0 if it has none)."""
    try:
        return int(json.loads(data or b"{}").get("g") or 0)
    except (ValueError, TypeError, AttributeError):
        return 0


async def open_watermarks(nc: NATS, stream: PartitionedStream) -> KeyValue:
    """The stream's watermark bucket, created (history 1, the stream's replicas) if new."""
    js = jetstream(nc)
    with contextlib.suppress(BucketNotFoundError, NotFoundError):
        return await js.key_value(watermark_bucket(stream.name))
    return await js.create_key_value(
        api.KeyValueConfig(
            bucket=watermark_bucket(stream.name),
            history=1,
            replicas=stream.replicas or 1,
            storage=api.StorageType.FILE,
            description=f"nats-ordered global-order watermarks of stream {stream.name}",
        )
    )


async def open_global_order(
    nc: NATS, stream: PartitionedStream, producer: str
) -> tuple[KeyValue, SequencerClaim, int]:
    """What a global-order publisher needs before it sends anything: the watermark bucket,
    the sequencer claim (:class:`~.sequencer.SequencerBusy` while another publisher
    holds it) and, taken after the claim, the first global sequence (:func:`global_base`)."""
    kv = await open_watermarks(nc, stream)
    claim = SequencerClaim(nc, kv, watermark_bucket(stream.name), stream.name, producer)
    await claim.claim()
    return kv, claim, await global_base(nc, stream)


async def global_base(nc: NATS, stream: PartitionedStream) -> int:
    """The first global sequence a new publisher may use: one above the largest found in
    every partition's last record (read from the stream leader; along a partition the
    sequence increases, so its last record holds its largest) and in every watermark."""
    js = jetstream(nc)
    top = 0

    async def last(p: int) -> int:
        try:
            msg = await js.get_last_msg(stream.name, stream.subject(p))
        except NotFoundError:
            return 0
        return parse_global_seq((msg.headers or {}).get(HDR_GLOBAL_SEQ)) or 0

    for g in await asyncio.gather(*(last(p) for p in range(stream.partitions))):
        top = max(top, g)
    bucket = watermark_bucket(stream.name)
    for key in await bucket_keys(nc, bucket, "w."):
        found = await latest_entry(nc, bucket, key)
        if found is not None:
            top = max(top, watermark_of(found[0]) - 1)
    return top + 1


class WatermarkWriter:
    """Writes the publisher's watermarks: at start, every ``interval`` seconds for the
    partitions whose lane is idle and whose watermark would rise, and after a flush; it
    renews the publisher's sequencer ``claim`` and writes nothing once the claim is lost.

    ``idle`` is the publisher's idle point (:data:`~..publish.sequence.IdlePoint`): its
    next global sequence and its idle partitions, read in one synchronous step."""

    def __init__(
        self,
        idle: Callable[[], tuple[int, list[int]]],
        producer_id: str,
        partitions: int,
        kv: KeyValue,
        interval: float,
        claim: SequencerClaim,
    ) -> None:
        self.idle = idle
        self.producer_id = producer_id
        self.kv = kv
        self.claim = claim
        self.interval = interval
        self.written = [0] * partitions
        self.task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one round at a time: a watermark never goes down

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def write(self) -> None:
        """One round: a watermark for every idle partition whose watermark would rise."""
        async with self._lock:
            await self._write()

    async def _write(self) -> None:
        if self.claim.lost:
            return
        g, idle = self.idle()  # the next global sequence and the idle lanes: one step
        due = [p for p in idle if g > self.written[p]]
        if not due:
            return
        value = compact_json({"g": g, "producer": self.producer_id, "ts": round(time.time(), 3)})

        async def put(p: int) -> None:
            try:
                await self.kv.put(f"w.{p}", value)
            except (NatsError, TimeoutError) as exc:  # the next round writes it again
                log.info("watermark of partition %d not written: %s", p, exc)
                return
            self.written[p] = max(self.written[p], g)

        await asyncio.gather(*(put(p) for p in due))

    async def close(self) -> None:
        """Stop writing and release the publisher's sequencer claim."""
        await self.stop()
        await self.claim.release()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.claim.renew_if_due()
                await self.write()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the writer die: watermarks are what readers wait on
                log.exception("watermark writer: unexpected error")


class GlobalOrder:
    """Global order for :class:`~..publish.publisher.OrderedPublisher`:
    ``PublisherConfig(global_order=GlobalOrder())`` (or ``OrderedPublisher(nc, stream,
    global_order=GlobalOrder())``) stamps every record with ``Nats-Global-Seq`` and writes
    the stream's watermarks (:class:`~..publish.sequence.StreamSequence`).

    :meth:`open` takes the stream's sequencer claim (:class:`~.sequencer.SequencerBusy`
    while another publisher holds it) and, after it, the first global sequence
    (:func:`global_base`). It holds no state: one instance serves any number of
    publishers, one after another."""

    header = HDR_GLOBAL_SEQ

    async def open(
        self,
        nc: NATS,
        stream: PartitionedStream,
        producer_id: str,
        idle: Callable[[], tuple[int, list[int]]],
        interval: float,
    ) -> tuple[int, WatermarkWriter]:
        kv, claim, base = await open_global_order(nc, stream, producer_id)
        return base, WatermarkWriter(idle, producer_id, stream.partitions, kv, interval, claim)

    def __repr__(self) -> str:
        return "GlobalOrder()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlobalOrder)

    def __hash__(self) -> int:
        return hash(GlobalOrder)


__all__ = [
    "HDR_GLOBAL_SEQ",
    "GlobalOrder",
    "WatermarkWriter",
    "global_base",
    "open_global_order",
    "open_watermarks",
    "parse_global_seq",
    "watermark_of",
]
