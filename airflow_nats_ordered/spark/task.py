"""What one Spark task does: publish its rows with the core publisher, report per partition.

One NATS connection and one :class:`~airflow_nats_ordered.core.publish.publisher.OrderedPublisher`
per task, created inside ``write()`` (nothing network-bound is pickled). Spark's input
iterator is read in a thread, a batch at a time, so the publisher keeps sending while the
next batch is decoded. A task whose records are not all confirmed as stored fails (Spark
retries it; the retry sends the same msg-ids, so the stream stores nothing twice).

Msg-ids are those of the core (producer id + the row's place in the input + key + payload,
``docs/protocol.md`` section 6, or the ``msgIdColumn``), with the task's *run producer id*:

* routed rows (a ``nats_partition`` column, as :func:`~airflow_nats_ordered.spark.route`
  makes them): the run's producer id; the place is the row's rank among the run's rows of
  its key (all in one task, sorted), independent of attempt, of Spark's physical
  partitioning and of the stream's partition count (:class:`~.resume.ResumingPublisher`);
  a position (``Nats-Ordered-Seq``) is the row's rank in its whole NATS partition (one
  task holds the whole partition). A resumed run starts each partition after what earlier attempts
  stored (``start_after``) and skips those rows, only while they are the rows stored
  (:mod:`.resume`: a changed input fails the task before anything more of it is sent);
* unrouted rows: the producer id plus ``.t<Spark partition id>``, so two tasks sharing a NATS
  partition never share an id (the place is the row's index in its task); nothing is
  skipped on resume
  (ids repeat only inside one Spark partition's recomputation);
* unrouted rows of a micro-batch (``content_ids``): ids derived from the rows themselves
  (:class:`~.records.ContentIds`: run, key, payload, headers, the copy's number among
  identical rows of the task), not from the task layout, so a micro-batch replayed with
  other Spark partitions (another core count, another ``repartition``) stores nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyspark.sql.datasource import WriterCommitMessage

from airflow_nats_ordered.core.errors import RecordError
from airflow_nats_ordered.core.publish.runs import _REASONS, Refusals
from airflow_nats_ordered.spark.options import PARTITION_COLUMN, SinkOptions
from airflow_nats_ordered.spark.preflight import last_seq, publisher_config
from airflow_nats_ordered.spark.records import BatchColumns, BatchRecords, SparkRecord
from airflow_nats_ordered.spark.resume import (
    ResumingPublisher,
    own_positions,
    resume_points,
    stored_tails,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from nats.aio.client import Client as NATS

    from airflow_nats_ordered.core.publish.runs import RunRecord


@dataclass
class TaskReport(WriterCommitMessage):
    """A task's commit message: what it published, per NATS partition.

    ``partitions``: partition -> ``{"offset", "accepted", "acked", "failed", "duplicates",
    "last_seq"}`` (offset: records of that partition stored by an earlier attempt of the
    run, skipped here). ``routed``: positions are ranks in whole NATS partitions.
    ``digests``: partition -> ``"<n>:<digest of the msg-ids of positions 1..n>"``.
    """

    task: int
    attempt: int
    producer_id: str
    routed: bool
    rows: int = 0
    skipped_run: bool = False
    partitions: dict[int, dict[str, int]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    refused_examples: list[dict[str, str]] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    #: the run (a micro-batch's run id: the driver's ``commit()`` learns it from the tasks)
    run: str = ""
    #: unrouted rows: the stream's last sequence when the task started (-1: not read)
    seq_before: int = -1


async def _publish_batches(
    pub: ResumingPublisher,
    batches: Iterator[pa.RecordBatch],
    maker: BatchRecords,
    refusals: Refusals,
    msg_id_field: str | None,
) -> None:
    """Publish every row, a batch at a time (as the core's ``publish_records`` does a record
    at a time: a refused row is counted in ``refusals`` with why, never dropped silently).
    The next batch is read in a thread while the publisher sends."""
    it = iter(batches)
    publish = pub.publish
    fast = pub.track and maker.routed and not maker.has_headers and not msg_id_field
    while True:
        batch = await asyncio.to_thread(next, it, None)
        if batch is None:
            return
        c = maker.columns(batch)
        if fast and not pub.resuming(c.parts):
            # routed rows without headers or caller msg-ids: a batch at a time
            def refused(i: int, exc: RecordError, c: BatchColumns = c) -> None:
                reason = next(r for t, r in _REASONS if isinstance(exc, t))
                rec = SparkRecord(c.keys[i], c.payloads[i], None, None, maker.task, c.first + i)
                refusals.add(reason, rec, str(exc))

            await pub.publish_routed(c.keys, c.payloads, c.parts, c.ranks, refused)
            continue
        for i, (key, data, mid, hdr, part, rank) in enumerate(
            zip(c.keys, c.payloads, c.ids, c.headers, c.parts, c.ranks, strict=True)
        ):
            if msg_id_field and mid is None:
                refusals.add(
                    "no msg-id",
                    SparkRecord(key, data, mid, hdr, maker.task, c.first + i),
                    f"field {msg_id_field!r} is missing or empty",
                )
                continue
            try:
                await publish(key, data, msg_id=mid, headers=hdr, partition=part, rank=rank)
            except RecordError as exc:
                reason = next(r for t, r in _REASONS if isinstance(exc, t))
                refusals.add(
                    reason, SparkRecord(key, data, mid, hdr, maker.task, c.first + i), str(exc)
                )


def drain(batches: Iterator[pa.RecordBatch]) -> int:
    """Consume the task's input without sending (the run is complete in the ledger)."""
    return sum(b.num_rows for b in batches)


async def publish_task(
    nc: NATS,
    options: SinkOptions,
    batches: Iterator[pa.RecordBatch],
    *,
    schema_names: list[str],
    run_producer_id: str,
    previous: RunRecord | None,
    after: Mapping[int, int],
    task: int,
    attempt: int,
    label: str,
    content_ids: bool = False,
    stored_at_start: Mapping[int, int] | None = None,
) -> TaskReport:
    """Publish one task's rows; raise if any was not confirmed as stored. Routed rows
    resume after what ``previous`` (the run's record when the job began) recorded or the
    stream holds now (an earlier attempt of this task may have stored more), counting only
    the run's messages after ``after`` (per partition, a stream sequence)."""
    routed = PARTITION_COLUMN in schema_names
    producer = run_producer_id if routed else f"{run_producer_id}.t{task}"
    resume = {}
    fence: dict[int, int] | None = None
    if routed:  # what earlier attempts of this job (a task retry) stored counts too
        tails = await stored_tails(nc, options.stream, run_producer_id)
        resume = resume_points(previous, own_positions(tails, after))
        # a failed attempt of this task can go on storing rows after this one read the
        # tails (its writer outlives the failure): each partition's first stored row
        # expects its subject to end where it ends now, and what was stored since is
        # passed over (the core publisher's fence), not sent again past the window
        fence = {p: t.seq for p, t in tails.items()}
    seq_before = -1 if routed else await last_seq(nc, options.stream)
    pub = ResumingPublisher(
        nc,
        options.stream,
        publisher_config(options, producer),
        resume=resume,
        run=run_producer_id,
        label=label,
        track=routed,
        stored_at_start=stored_at_start,
        fence=fence,
    )
    await pub.start()
    maker = BatchRecords(
        options,
        schema_names,
        pub.partitions,
        label,
        content_ids=run_producer_id if content_ids and not routed else None,
    )
    refusals = Refusals()
    try:
        await _publish_batches(pub, batches, maker, refusals, options.msg_id_column)
        pub.check_prefixes_read()
    except BaseException:
        with contextlib.suppress(Exception):
            await pub.close(raise_on_failure=False)
        raise
    await pub.close()  # raises PublishError if anything was not confirmed: task retry
    summary = pub.summary
    assert summary is not None
    return TaskReport(
        task=task,
        attempt=attempt,
        producer_id=producer,
        routed=routed,
        rows=maker.rows,
        partitions={
            p.partition: {
                "offset": p.offset,
                "accepted": p.accepted,
                "acked": p.acked,
                "failed": p.failed,
                "duplicates": p.duplicates or 0,
                "last_seq": p.last_seq,
            }
            for p in summary.partitions
            if p.accepted or p.offset
        },
        refused=dict(refusals.counts),
        refused_examples=list(refusals.examples),
        digests=pub.digests() if routed else {},
        run=run_producer_id,
        seq_before=seq_before,
    )
