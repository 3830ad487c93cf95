"""``write_ordered``: the common case in one call, routing included."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from ..core.errors import ConfigError
from ..core.publisher import check_producer_id
from ..core.runs import RunLedger, RunRecord
from .datasource import NAME, _on_nats, register
from .options import CONNECTION_OPTIONS, SinkOptions
from .routing import KEY_TEXT_COLUMN, check_key_column, is_integral_key, route

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
    text of ``core/keys.py``. Other column types are refused before any job runs.
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

    async def facts(nc: NATS) -> tuple[int, RunRecord | None]:
        ledger = await RunLedger.open(nc, stream)
        return ledger.stream.partitions, await ledger.get(producer_id)

    partitions, previous = _on_nats(options, facts)
    if previous is not None and previous.status == "complete":
        log.info(
            "run %r is complete in the ledger of %s (%d rows acknowledged): nothing published",
            producer_id,
            stream,
            previous.acked,
        )
        return previous
    routed = route(
        df, key=key, partitions=partitions, order_by=order, tie_breaker=tie_breaker, tasks=tasks
    )
    if integral:
        # the sink publishes the key's canonical text (exact decimal digits, as Spark's
        # cast of an integral column gives), from a column left out of the payload
        from pyspark.sql import functions as F

        routed = routed.withColumn(KEY_TEXT_COLUMN, F.col(key).cast("string"))
        spark_options["keyColumn"] = KEY_TEXT_COLUMN
    register(df.sparkSession)
    routed.write.format(NAME).options(**spark_options).mode("append").save()

    async def result(nc: NATS) -> RunRecord | None:
        return await (await RunLedger.open(nc, stream)).get(producer_id)

    rec = _on_nats(options, result)
    if rec is None:
        raise RuntimeError(f"run {producer_id!r} left no record in the ledger of {stream}")
    return rec
