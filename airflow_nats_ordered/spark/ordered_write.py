"""``write_ordered``: the common case in one call, routing included; ``ordered_batches``:
the same for each micro-batch of a streaming query (``foreachBatch``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.config import check_producer_id
from airflow_nats_ordered.core.publish.runs import RunLedger, RunRecord
from airflow_nats_ordered.spark.datasource import NAME, _on_nats
from airflow_nats_ordered.spark.discovery import register
from airflow_nats_ordered.spark.global_stamp import (
    GLOBAL_SEQ_COLUMN,
    DriverSequencer,
    with_global_seq,
)
from airflow_nats_ordered.spark.options import CARRIED_OVER_OPTION, CONNECTION_OPTIONS, SinkOptions
from airflow_nats_ordered.spark.repartitioned import carry_over, pass_over_old_layout
from airflow_nats_ordered.spark.routing import (
    KEY_TEXT_COLUMN,
    check_key_column,
    is_integral_key,
    route,
)
from airflow_nats_ordered.spark.runs import batch_run_id

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)


def write_ordered(
    df: DataFrame,
    *,
    stream: str,
    key: str,
    producer_id: str,
    order_by: Sequence[str] | str = (),
    tie_breaker: Sequence[str] | None = None,
    msg_id_column: str | None = None,
    allow_refused: bool = False,
    tasks: int | None = None,
    connection: Mapping[str, str] | None = None,
    global_order: bool = False,
) -> RunRecord:
    """Publish ``df`` to ``stream`` keyed by ``key``, in ``order_by`` order per key, as the
    run ``producer_id``; returns the run's ledger record (status, per-partition high-water
    marks for the drain sensor, counts, refusals).

    Routes every row with the one partition function and sorts each NATS partition in one
    Spark task (:func:`~airflow_nats_ordered.spark.route`), so the stream holds each
    partition in (``order_by``, tie-breaker) order, with msg-ids that do not depend on
    Spark's partitioning or on retries. A run the ledger has as complete is not computed or
    published again. ``producer_id`` must name one immutable input (a DAG run's logical date,
    a snapshot): the same id on every retry or re-submit of it, a new id for new input.
    ``connection``: non-secret connection options (``url``, ``user``, ``tlsCa``, ...);
    secrets come from the ``NATS_*`` environment. Raises if the run ends partial.

    ``key`` (and ``msg_id_column``) must be a string, UTF-8 binary or integral column; an
    integral key is published (and routed) as its exact decimal text, the canonical key
    text of ``core/stream/keys.py``. Other column types are refused before any job runs.

    ``global_order=True`` also stamps every row with ``Nats-Global-Seq`` in (``order_by``,
    tie-breaker) order over the whole DataFrame, for a global-order reader (one order over
    all keys); the driver holds the stream's sequencer claim while the job runs and writes
    the partitions' watermarks when the run is complete (:mod:`.global_stamp`).
    """
    order = [c.strip() for c in order_by.split(",")] if isinstance(order_by, str) else order_by
    # refused in this function's terms (not as the data source's producerId option)
    check_producer_id(producer_id, "producer_id", "no default: name the input this run publishes")
    check_key_column(df, key)
    if msg_id_column:
        check_key_column(df, msg_id_column, "msg_id_column")
    integral = is_integral_key(df, key)
    if integral and KEY_TEXT_COLUMN in df.columns:
        raise ConfigError(
            f"column {KEY_TEXT_COLUMN!r} is reserved for the text of an integral key column; "
            "rename it"
        )
    extra = {str(k): str(v) for k, v in (connection or {}).items()}
    bad = sorted(k for k in extra if k.lower() not in CONNECTION_OPTIONS)
    if bad:
        raise ConfigError(
            f"connection option(s) {', '.join(bad)} are not accepted here; use "
            f"{', '.join(sorted(CONNECTION_OPTIONS))} (secrets come from NATS_* variables)"
        )
    spark_options = {
        "stream": stream,
        "keyColumn": key,
        "producerId": producer_id,
        "allowRefused": str(allow_refused).lower(),
        **extra,
    }
    if order:
        spark_options["orderBy"] = ",".join(order)
    if msg_id_column:
        spark_options["msgIdColumn"] = msg_id_column
    options = SinkOptions.from_spark(spark_options)
    spark_options.update(options.pinned_connection())  # the sink uses what we read here

    async def facts(nc: NATS) -> tuple[int, RunRecord | None, tuple[int, dict[int, int]] | None]:
        ledger = await RunLedger.open(nc, stream)
        previous = await ledger.get(producer_id)
        # a run begun before a repartition: what the old layout stored of it is passed over
        return ledger.stream.partitions, previous, await carry_over(nc, ledger, previous)

    partitions, previous, before_switch = _on_nats(options, facts)
    if previous is not None and previous.status == "complete":
        log.info(
            "run %r is complete in the ledger of %s (%d rows acknowledged): nothing published",
            producer_id,
            stream,
            previous.acked,
        )
        return previous
    if global_order:
        if before_switch is not None:  # a stamped stream is never repartitioned
            raise ConfigError(
                f"run {producer_id!r} began before stream {stream} was repartitioned: it "
                "cannot be continued in global order; publish it under a new producer_id"
            )
        return _write_global(
            df,
            stream=stream,
            key=key,
            producer_id=producer_id,
            order=list(order),
            tie_breaker=list(tie_breaker) if tie_breaker else None,
            partitions=partitions,
            tasks=tasks,
            integral=integral,
            options=options,
            spark_options=spark_options,
        )
    if before_switch is not None:
        spark_options[CARRIED_OVER_OPTION] = "true"  # the sink refuses a direct write of it
        df = pass_over_old_layout(
            df,
            key=key,
            order_by=order,
            tie_breaker=tie_breaker,
            partitions=before_switch[0],
            stored=before_switch[1],
        )
    routed = route(
        df, key=key, partitions=partitions, order_by=order, tie_breaker=tie_breaker, tasks=tasks
    )
    return _save(routed, key=key, integral=integral, options=options, spark_options=spark_options)


def _save(
    routed: DataFrame,
    *,
    key: str,
    integral: bool,
    options: SinkOptions,
    spark_options: dict[str, str],
) -> RunRecord:
    """Write the routed rows with the sink; the run's ledger record after the write."""
    if integral:
        # the sink publishes the key's canonical text (exact decimal digits, as Spark's
        # cast of an integral column gives), from a column left out of the payload
        from pyspark.sql import functions as F

        routed = routed.withColumn(KEY_TEXT_COLUMN, F.col(key).cast("string"))
        spark_options["keyColumn"] = KEY_TEXT_COLUMN
    register(routed.sparkSession)
    routed.write.format(NAME).options(**spark_options).mode("append").save()
    stream, producer_id = spark_options["stream"], spark_options["producerId"]

    async def result(nc: NATS) -> RunRecord | None:
        return await (await RunLedger.open(nc, stream)).get(producer_id)

    rec = _on_nats(options, result)
    if rec is None:
        raise RuntimeError(f"run {producer_id!r} left no record in the ledger of {stream}")
    return rec


def _write_global(
    df: DataFrame,
    *,
    stream: str,
    key: str,
    producer_id: str,
    order: list[str],
    tie_breaker: list[str] | None,
    partitions: int,
    tasks: int | None,
    integral: bool,
    options: SinkOptions,
    spark_options: dict[str, str],
) -> RunRecord:
    """``write_ordered`` with ``global_order``: numbered, routed and sorted by the number."""
    seq = DriverSequencer(options, stream, producer_id)
    base = seq.start()  # SequencerBusy while another global-order publisher runs
    complete = False
    try:
        stamped = with_global_seq(df, key=key, order_by=order, tie_breaker=tie_breaker, base=base)
        # each NATS partition in one task sorted by the number, which follows (order_by,
        # tie-breaker): the sink's own order check still holds, and the sequence increases
        # along every partition
        routed = route(
            stamped,
            key=key,
            partitions=partitions,
            order_by=[GLOBAL_SEQ_COLUMN],
            tie_breaker=[GLOBAL_SEQ_COLUMN],
            tasks=tasks,
        ).drop(GLOBAL_SEQ_COLUMN)
        rec = _save(
            routed, key=key, integral=integral, options=options, spark_options=spark_options
        )
        complete = rec.status == "complete"
    finally:
        seq.finish(complete=complete)
    return rec


def ordered_batches(
    *,
    stream: str,
    key: str,
    producer_id: str,
    order_by: Sequence[str] | str = (),
    tie_breaker: Sequence[str] | None = None,
    msg_id_column: str | None = None,
    allow_refused: bool = False,
    tasks: int | None = None,
    connection: Mapping[str, str] | None = None,
    global_order: bool = False,
) -> Callable[[DataFrame, int], None]:
    """A ``foreachBatch`` function publishing each micro-batch with :func:`write_ordered`:
    routed, each NATS partition in one task sorted by (``order_by``, tie-breaker), so every
    key is stored in that order, and resumed from what is stored on a replay (at any time,
    not only inside the duplicate window)::

        stream_df.writeStream.foreachBatch(
            ordered_batches(stream="EVENTS", key="k", order_by="ts", producer_id="events")
        ).option("checkpointLocation", "/chk/events").start()

    Micro-batch ``i`` of the query is the run :func:`~.runs.batch_run_id` (``producer_id``,
    ``i``, the query's id): a new checkpoint is a new query whose runs are new. Raises (the
    query fails) if a micro-batch ends partial."""
    check_producer_id(
        producer_id, "producer_id", "no default: name the stream this query publishes"
    )

    def write_batch(df: DataFrame, batch_id: int) -> None:
        query = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        if not query:
            raise RuntimeError(
                "ordered_batches runs as a streaming query's foreachBatch function only "
                "(no sql.streaming.queryId in this thread)"
            )
        write_ordered(
            df,
            stream=stream,
            key=key,
            producer_id=batch_run_id(producer_id, batch_id, query),
            order_by=order_by,
            tie_breaker=tie_breaker,
            msg_id_column=msg_id_column,
            allow_refused=allow_refused,
            tasks=tasks,
            connection=connection,
            global_order=global_order,
        )

    return write_batch
