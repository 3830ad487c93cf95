"""Global order from the Spark sink: ``write_ordered(..., global_order=True)`` stamps every
row with ``Nats-Global-Seq`` in (``order_by``, tie-breaker) order over the whole DataFrame,
so a :class:`~airflow_nats_ordered.core.order.reader.GlobalOrderReader` hands the run's rows
to its handler in that one order across all keys and partitions (issue 18 part 1).

How the core's guarantees carry over (``docs/architecture/order.md``, *Global order*):

* **One sequencer.** The driver takes the stream's sequencer claim before any Spark job runs
  (:class:`~airflow_nats_ordered.core.order.sequencer.SequencerBusy` while another
  global-order publisher holds it) and renews it from a thread of its own until the write
  ends; the first sequence is :func:`~airflow_nats_ordered.core.order.watermarks.global_base`,
  above everything stored or promised, read after the claim is taken.
* **Sequences in order.** Row ``i`` of the DataFrame sorted by (``order_by``, tie-breaker)
  gets ``base + i``: Spark sorts globally (range partitioning) and numbers the sorted rows
  (``zipWithIndex``). Each NATS partition is then published by one task sorted by that
  number, so along every partition the sequence increases, as the reader requires.
  Sequences are a function of the input and ``base``: a Spark task retry stamps the same
  ones.
* **Watermarks.** The tasks write none (several tasks publish at once, no single one knows
  when a partition is done). When the run ends complete the driver, still holding the
  claim, writes every partition's watermark as ``global_base`` then (everything of the run
  is stored; a later publisher starts at least there) and gives the claim back. While the
  job runs a reader releases what it can prove, and holds the rest until the run ends: the
  latency of a partition that gets no more rows is the rest of the job.
* **Re-submits.** A run that ended partial and is written again passes over what is stored
  (keeping the sequences it got then) and numbers the rest from a new base, above everything
  stored, as a retried core run does: their order is the order of publishing.

What it costs: one more sort of the whole DataFrame and a pass of every row through Python
(the numbering), before the routing shuffle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.order.watermarks import (
    HDR_GLOBAL_SEQ,
    global_base,
    open_global_order,
)
from airflow_nats_ordered.core.stream.kv import compact_json
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.spark.options import HEADERS_COLUMN, SinkOptions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)

#: the column holding a row's global sequence between numbering and routing (dropped before
#: the sink sees the rows; it is not part of the payload)
GLOBAL_SEQ_COLUMN = "__nats_global_seq"

#: how often the claim thread checks whether the claim is due for renewal
_TICK = 0.5


class DriverSequencer:
    """The stream's sequencer claim, held by the Spark driver for one run.

    :meth:`start` takes the claim and returns the first global sequence; a thread with its
    own event loop and connection renews the claim while Spark runs the job. :meth:`finish`
    writes every partition's watermark (only for a run that ended complete) and gives the
    claim back; it raises if the claim was lost meanwhile (not renewed for the claim's
    staleness limit, e.g. a driver paused that long: another publisher may have numbered
    records in between)."""

    def __init__(self, options: SinkOptions, stream: str, producer: str) -> None:
        self.options = options
        self.stream = stream
        self.producer = producer
        self.base = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._watermarks = False
        self._lost = False
        self._thread = threading.Thread(
            target=self._run, name=f"nats-sequencer-{stream}", daemon=True
        )

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self.base

    def finish(self, *, complete: bool) -> None:
        self._watermarks = complete
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._lost:
            raise RuntimeError(
                f"the sequencer claim of run {self.producer!r} on stream {self.stream} was "
                "taken over by another global-order publisher while the job ran (the driver "
                "did not renew it in time): records that publisher numbered meanwhile may "
                "interleave with this run's out of order; a global-order reader stops with "
                "GlobalOrderViolation where they do. No watermarks were written for this run"
            )

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - handed to the driver's thread
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await connect(self.options.connection_options())
        try:
            stream = await describe(nc, self.stream)
            kv, claim, self.base = await open_global_order(nc, stream, self.producer)
            self._ready.set()
            try:
                while not self._stop.is_set():
                    await claim.renew_if_due()
                    if claim.lost:
                        self._lost = True
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), _TICK)
                if self._watermarks:
                    # the run is stored: every partition's next record (of a later
                    # publisher, which starts at global_base or above) is at least here
                    top = await global_base(nc, stream)
                    value = compact_json(
                        {"g": top, "producer": self.producer, "ts": round(time.time(), 3)}
                    )
                    for p in range(stream.partitions):
                        await kv.put(f"w.{p}", value)
            finally:
                await claim.release()
        finally:
            await nc.close()


def with_global_seq(
    df: DataFrame, *, key: str, order_by: list[str], tie_breaker: list[str] | None, base: int
) -> DataFrame:
    """``df`` with :data:`GLOBAL_SEQ_COLUMN` (``base`` + the row's rank in (``order_by``,
    tie-breaker) order over the whole DataFrame) and its ``headers`` column carrying it as
    ``Nats-Global-Seq`` (added to the row's own headers when the column is a map)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, LongType, MapType, StringType

    if GLOBAL_SEQ_COLUMN in df.columns:
        raise ConfigError(f"column {GLOBAL_SEQ_COLUMN!r} is reserved for global_order; rename it")
    stamp_value = F.col(GLOBAL_SEQ_COLUMN).cast("string")
    if HEADERS_COLUMN in df.columns:
        kind = df.schema[HEADERS_COLUMN].dataType
        if not (
            isinstance(kind, MapType)
            and isinstance(kind.keyType, StringType)
            and isinstance(kind.valueType, StringType | BinaryType)
        ):
            raise ConfigError(
                f"global_order=True adds {HDR_GLOBAL_SEQ} to the {HEADERS_COLUMN!r} column, "
                f"which must then be map<string,string> or map<string,binary> (it is "
                f"{kind.simpleString()}); convert Kafka's array form with "
                f"F.map_from_entries('{HEADERS_COLUMN}')"
            )
        if isinstance(kind.valueType, BinaryType):
            stamp_value = stamp_value.cast("binary")
    row = [F.col(c) for c in df.columns]
    ties = [F.col(c) for c in tie_breaker] if tie_breaker else [F.col(key), F.xxhash64(*row)]
    ordered = df.orderBy(*[F.col(c) for c in order_by], *ties).persist(StorageLevel.MEMORY_AND_DISK)
    schema = ordered.schema.add(GLOBAL_SEQ_COLUMN, LongType(), nullable=False)
    numbered = ordered.rdd.zipWithIndex().map(lambda pair: (*pair[0], base + pair[1]))
    stamped = df.sparkSession.createDataFrame(numbered, schema)
    stamp = F.create_map(F.lit(HDR_GLOBAL_SEQ), stamp_value)
    if HEADERS_COLUMN in df.columns:
        own = F.col(HEADERS_COLUMN)
        headers = F.when(own.isNull(), stamp).otherwise(F.map_concat(own, stamp))
    else:
        headers = stamp
    return stamped.withColumn(HEADERS_COLUMN, headers)
