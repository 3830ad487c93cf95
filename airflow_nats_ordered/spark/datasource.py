"""The ``nats-ordered`` PySpark data source: an ordered, retry-safe sink to a partitioned stream.

Found by Spark without registration in any directory and thread (:mod:`.discovery`)::

    (df.write.format("nats-ordered").option("stream", "FLIGHTS").option("keyColumn", "tailnum")
       .option("orderBy", "sched_dep").option("producerId", run_id).mode("append").save())

Guarantees (details in :mod:`.task` and :mod:`.runs`):

* **Effectively once under retries.** Msg-ids are deterministic per row (producer id, the
  row's place in the input, key, payload, or the ``msgIdColumn``) and do not depend on the
  task attempt; routed rows' ids (the place: the row's rank among the run's rows of its key)
  depend neither on Spark's partitioning nor on the stream's partition count. A retried task or
  stage, a re-submitted job or an Airflow retry stores nothing twice inside the stream's
  ``duplicate_window``. Routed rows also resume from what is stored, at any time: a complete
  run sends nothing, and each task passes over per partition what the ledger recorded or the
  stream holds of the run (a killed driver or an aborted job), only while those are the same
  rows (:mod:`.resume`: changed input fails the task, naming a new ``producerId`` as the fix).
* **Order.** A task publishes its rows in the order it receives them; a NATS partition's rows
  arriving out of ``orderBy`` order fail the task before anything out of order is sent. Per
  key order across the whole write holds when each key's rows are in one task, in order:
  what :func:`~airflow_nats_ordered.spark.write_ordered` guarantees.
* **Nothing dropped silently.** Rows without a key, too large or with headers that cannot
  be sent (:mod:`.headers`) are counted and reported in the run record; the job fails
  unless ``allowRefused`` is true.
* **Kafka-sink conventions.** The key is the column ``key`` unless ``keyColumn`` names
  another; ``value`` is the payload; ``headers`` is a map or Kafka's array of key/value
  structs. Only ``mode("append")`` (Spark refuses its default mode for a Python source).
* **Refused before anything is sent.** Options, column types (key, value, headers) and a
  stream whose ``duplicate_window`` is shorter than a task's resends (``deliveryTimeout``,
  :mod:`.preflight`) are checked on the driver when the writer is created, before the run
  is begun in the ledger.
* **Streaming.** One run per micro-batch (``<producerId>.<query id>.batch-<id>``: a new
  checkpoint is a new query, whose batch 0 is not the old query's), whose id is in every
  derived msg-id; unrouted rows' ids come from the rows, not the task layout. A micro-batch
  replayed after a restart stores nothing twice inside the duplicate window (past it too
  when its rows are routed), whatever the core count.
  ``orderBy`` is refused on unrouted streaming writes (a key's rows in two tasks would
  interleave): use :func:`~.ordered_write.ordered_batches` with ``foreachBatch``.
* **Routing.** A ``nats_partition`` column is checked against the stream's routing of each
  key before a row of its batch is sent (:class:`~.records.RoutingError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.spark.headers import check_headers_type
from airflow_nats_ordered.spark.options import (
    DEFAULT_KEY_COLUMN,
    HEADERS_COLUMN,
    PARTITION_COLUMN,
    VALUE_COLUMN,
    SinkOptions,
)
from airflow_nats_ordered.spark.preflight import check_resend_window, last_seq
from airflow_nats_ordered.spark.routing import check_key_type
from airflow_nats_ordered.spark.runs import (
    RunPlan,
    RunRefusedError,
    batch_run_id,
    plan_run,
    record_run,
)
from airflow_nats_ordered.spark.task import TaskReport, drain, publish_task

if TYPE_CHECKING:
    import pyarrow as pa
    from nats.aio.client import Client as NATS
    from pyspark.sql.types import StructType

NAME = "nats-ordered"
T = TypeVar("T")


def _on_nats(options: SinkOptions, fn: Callable[[NATS], Awaitable[T]]) -> T:
    async def main() -> T:
        nc = await connect(options.connection_options())
        try:
            return await fn(nc)
        except Exception as exc:
            denied = options.denial_in_spark_terms(exc)  # names the option that gave the user
            if denied is None:
                raise
            raise denied from exc
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.drain(), 5)

    return asyncio.run(main())


def _check_schema(options: SinkOptions, schema: StructType) -> None:
    from pyspark.sql.types import BinaryType, StringType

    fields = {f.name: f.dataType for f in schema.fields}

    def need(column: str, what: str) -> None:
        if column not in fields:
            raise ConfigError(
                f"{what} {column!r} is not a column of the DataFrame (columns: {', '.join(fields)})"
            )

    if options.key_column not in fields and options.key_defaulted:
        raise ConfigError(
            f"option keyColumn is required for format 'nats-ordered' unless the DataFrame has "
            f"a column {DEFAULT_KEY_COLUMN!r} (the default, as in Spark's Kafka sink); "
            f'columns: {", ".join(fields)}. Name the key: .option("keyColumn", "tailnum")'
        )
    need(options.key_column, "keyColumn")
    check_key_type(schema, options.key_column, "keyColumn")
    for c in options.order_by:
        need(c, "orderBy column")
    if options.msg_id_column:
        need(options.msg_id_column, "msgIdColumn")
    if VALUE_COLUMN in fields and not isinstance(fields[VALUE_COLUMN], StringType | BinaryType):
        raise ConfigError(
            f"column {VALUE_COLUMN!r} is the payload and must be string or binary, not "
            f"{fields[VALUE_COLUMN].simpleString()}; rename it to send the row as JSON"
        )
    if HEADERS_COLUMN in fields:
        check_headers_type(fields[HEADERS_COLUMN])


def _task() -> tuple[Any, int, int]:
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        raise RuntimeError("the nats-ordered writer runs inside a Spark task only")
    return tc, tc.partitionId(), tc.attemptNumber()


class NatsOrderedWriter(DataSourceArrowWriter):
    """Batch writer: the run is planned on the driver when the writer is created."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema_names = [f.name for f in schema.fields]
        self.created = time.time()
        self.routed = PARTITION_COLUMN in self.schema_names

        async def start(nc: NATS) -> tuple[int, RunPlan]:
            try:  # before the run is begun: a refusal here leaves the ledger alone
                await check_resend_window(nc, options)
            except ConfigError:
                plan = await plan_run(nc, options.stream, options.producer_id, begin=False)
                if plan.complete:  # nothing will be sent: no resend to de-duplicate
                    return 0, plan
                raise
            seq = await last_seq(nc, options.stream)
            return seq, await plan_run(
                nc,
                options.stream,
                options.producer_id,
                begin=True,
                routed=self.routed,
                carried_over=options.carried_over,
            )

        #: the stream's last sequence before this job: unrouted rows' duplicates count from it
        self.seq_before, self.plan = _on_nats(options, start)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        _, task, attempt = _task()
        if self.plan.complete:
            return TaskReport(
                task, attempt, self.options.producer_id, False, drain(iterator), skipped_run=True
            )
        return _on_nats(
            self.options,
            lambda nc: publish_task(
                nc,
                self.options,
                iterator,
                schema_names=self.schema_names,
                run_producer_id=self.plan.run_id,
                previous=self.plan.previous,
                # a run without a record before (never published, or forgotten on purpose
                # to replay it) resumes only after what this job's own attempts stored
                after=self.plan.after,
                # what was stored when the job began: a stored row past it is this job's
                stored_at_start={p: r.count for p, r in self.plan.resume.items()},
                task=task,
                attempt=attempt,
                label=f"Spark partition {task} (attempt {attempt})",
            ),
        )

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        if self.plan.complete:
            return
        rec = _on_nats(
            self.options,
            lambda nc: record_run(
                nc,
                self.options,
                self.plan.run_id,
                _reports(messages),
                resume=self.plan.resume,
                seq_before=None if self.routed else self.seq_before,
            ),
        )
        if rec.status != "complete":
            raise RunRefusedError(f"run {rec.producer_id!r} is recorded partial: {rec.error}")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        if self.plan.complete:
            return
        _on_nats(
            self.options,
            lambda nc: record_run(
                nc,
                self.options,
                self.plan.run_id,
                _reports(messages),
                error="the Spark job was aborted (a task failed for good: see the Spark "
                "error); "
                + (
                    "acked_per_partition counts what the stream holds of this run, and "
                    "re-submitting the job with the same input resumes after it"
                    if self.routed
                    else "the rows were not routed, so a re-submit is de-duplicated only "
                    "inside the stream's duplicate_window"
                ),
                unless_finished_after=self.created,
                from_stream=self.routed,
            ),
        )


def _refuse_unkept_order(options: SinkOptions, schema_names: list[str]) -> None:
    if options.order_by and PARTITION_COLUMN not in schema_names:
        raise ConfigError(
            f"option orderBy ({','.join(options.order_by)}) cannot be kept by a streaming "
            "write: the sink gets each micro-batch's rows per Spark task, and a key whose "
            "rows are in two tasks would be stored interleaved, out of that order. Route and "
            "sort each micro-batch instead: stream_df.writeStream.foreachBatch("
            "ordered_batches(stream=..., key=..., order_by=[...], producer_id=...)) "
            "(from airflow_nats_ordered.spark: write_ordered per micro-batch), or remove "
            "orderBy to publish each task's rows as they arrive, without a declared order"
        )


class NatsOrderedStreamWriter(DataSourceStreamArrowWriter):
    """Structured Streaming writer: each micro-batch is a run
    ``<producerId>.<query id>.batch-<id>`` (:func:`~.runs.batch_run_id`)."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema_names = [f.name for f in schema.fields]
        _refuse_unkept_order(options, self.schema_names)
        _on_nats(options, lambda nc: check_resend_window(nc, options))
        self.created = time.time()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        tc, task, attempt = _task()
        batch = tc.getLocalProperty("streaming.sql.batchId")
        query = tc.getLocalProperty("sql.streaming.queryId")
        if batch is None or not query:
            raise RuntimeError(
                "no micro-batch id or query id in the task context (streaming.sql.batchId, "
                "sql.streaming.queryId): the nats-ordered stream writer needs both"
            )
        run_id = batch_run_id(self.options.producer_id, int(batch), query)

        async def go(nc: NATS) -> TaskReport:
            plan = await plan_run(nc, self.options.stream, run_id, begin=False, routed=False)
            if plan.complete:  # replayed after its commit was recorded: send nothing
                return TaskReport(
                    task, attempt, run_id, False, drain(iterator), skipped_run=True, run=run_id
                )
            return await publish_task(
                nc,
                self.options,
                iterator,
                schema_names=self.schema_names,
                run_producer_id=run_id,
                previous=plan.previous,
                # a micro-batch's run is recorded only at its end: a replay of one killed
                # before that resumes from the stream alone
                after={},
                task=task,
                attempt=attempt,
                label=f"micro-batch {batch}, Spark partition {task} (attempt {attempt})",
                content_ids=True,
            )

        return _on_nats(self.options, go)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        reports = _reports(messages)
        if reports and all(r is not None and r.skipped_run for r in reports):
            return
        run_id = _run_of(reports)
        if run_id is None:  # no task ran: nothing was published, nothing to record
            return
        starts = [
            r.seq_before for r in reports if r is not None and not (r.routed or r.skipped_run)
        ]
        seq_before = min(starts) if starts and min(starts) >= 0 else None
        rec = _on_nats(
            self.options,
            lambda nc: record_run(nc, self.options, run_id, reports, seq_before=seq_before),
        )
        if rec.status != "complete":
            raise RunRefusedError(f"run {rec.producer_id!r} is recorded partial: {rec.error}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        run_id = _run_of(_reports(messages))
        if run_id is None:  # no task reported (the driver sees no query id): the replay
            return  # after a restart resumes or de-duplicates from the stream itself
        _on_nats(
            self.options,
            lambda nc: record_run(
                nc,
                self.options,
                run_id,
                _reports(messages),
                error="the micro-batch was aborted; restarting the query from its checkpoint "
                "replays it"
                + (
                    ", resuming after what the stream holds of it"
                    if PARTITION_COLUMN in self.schema_names
                    else " (rows not routed: de-duplicated inside the stream's duplicate_window)"
                ),
                unless_finished_after=self.created,
                from_stream=PARTITION_COLUMN in self.schema_names,
            ),
        )


def _reports(messages: list[WriterCommitMessage | None]) -> list[TaskReport | None]:
    return [m if isinstance(m, TaskReport) else None for m in messages]


def _run_of(reports: list[TaskReport | None]) -> str | None:
    """A micro-batch's run id, as its tasks computed it from their query and batch ids (the
    driver-side ``commit()`` and ``abort()`` get the batch id only)."""
    return next((r.run for r in reports if r is not None and r.run), None)


class NatsOrderedDataSource(DataSource):
    """``format("nats-ordered")``: see the module docstring for options and guarantees."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def _options(self, schema: StructType, overwrite: bool) -> SinkOptions:
        if overwrite:
            raise ConfigError(
                "format 'nats-ordered' appends to a stream and cannot overwrite it; use "
                '.mode("append")'
            )
        options = SinkOptions.from_spark(self.options)
        _check_schema(options, schema)
        return options

    def writer(self, schema: StructType, overwrite: bool) -> NatsOrderedWriter:
        return NatsOrderedWriter(self._options(schema, overwrite), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> NatsOrderedStreamWriter:
        return NatsOrderedStreamWriter(self._options(schema, overwrite), schema)
