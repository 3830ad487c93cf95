"""The global sequence's wire parts: the ``Nats-Global-Seq`` header, the watermark bucket
``nor_<stream>_global`` and the publisher's watermark writer (:class:`WatermarkWriter`).

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
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.order.sequencer import SequencerClaim
from airflow_nats_ordered.core.stream.kv import bucket_keys, compact_json, latest_entry
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream

if TYPE_CHECKING:
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

log = logging.getLogger(__name__)

#: the header carrying a record's global sequence (decimal, >= 1)
HDR_GLOBAL_SEQ = "Nats-Global-Seq"


def watermark_bucket(stream: str) -> str:
    """The KV bucket holding the stream's per-partition watermarks (keys ``w.<n>``)."""
    return f"nor_{stream}_global"


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
    js = nc.jetstream()
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
    js = nc.jetstream()
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
    renews the publisher's sequencer ``claim`` and writes nothing once the claim is lost."""

    def __init__(
        self, pub: OrderedPublisher, kv: KeyValue, interval: float, claim: SequencerClaim
    ) -> None:
        self.pub = pub
        self.kv = kv
        self.claim = claim
        self.interval = interval
        self.written = [0] * pub.partitions
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
        pub = self.pub
        g = pub._next_g  # with the idle checks below, one synchronous step
        due = [
            lane.p
            for lane in pub._lanes
            if g > self.written[lane.p]
            and lane.error is None
            and not lane.queue
            and not lane.inflight
        ]
        if not due:
            return
        value = compact_json({"g": g, "producer": pub.producer_id, "ts": round(time.time(), 3)})

        async def put(p: int) -> None:
            try:
                await self.kv.put(f"w.{p}", value)
            except (NatsError, TimeoutError) as exc:  # the next round writes it again
                log.info("watermark of partition %d not written: %s", p, exc)
                return
            self.written[p] = max(self.written[p], g)

        await asyncio.gather(*(put(p) for p in due))

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


__all__ = [
    "HDR_GLOBAL_SEQ",
    "WatermarkWriter",
    "global_base",
    "open_global_order",
    "open_watermarks",
    "parse_global_seq",
    "watermark_bucket",
    "watermark_of",
]
