"""A Spark write as a run of the stream's run ledger (see
:mod:`airflow_nats_ordered.core.publish.runs`).

A batch write is the run ``producerId``; a streaming query writes one run per micro-batch,
``<producerId>.<query id>.batch-<batch id>`` (:func:`batch_run_id`). On the driver, before any
task starts, a run the ledger has as ``complete`` is not published again (tasks read their input
and send nothing), otherwise it is begun (``running``, one more attempt) and each task of routed
rows resumes after what is stored: what the ledger recorded, or, where a partition's last
message is the run's, its position (a killed driver or an aborted job recorded nothing of it),
checked to be the same input (:mod:`.resume`). The driver's ``commit()`` records the result from
the tasks' reports (per-partition high-water marks and counts, digests, refusals; ``complete``
or ``partial``), ``abort()`` records the failure with what the stream holds of the run, so the
drain sensor and backfills read a run's outcome by its name. Marks only go up across attempts
and cover every partition any attempt stored (as for every run, see
:mod:`airflow_nats_ordered.core.publish.runs`).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.publish.runs import (
    REFUSED_EXAMPLES,
    RunLedger,
    RunRecord,
    fill_marks,
    raise_marks,
    unmarked_error,
)
from airflow_nats_ordered.spark.options import SinkOptions
from airflow_nats_ordered.spark.preflight import last_seq
from airflow_nats_ordered.spark.repartitioned import refusal
from airflow_nats_ordered.spark.resume import (
    PartitionResume,
    own_positions,
    resume_points,
    stored_tails,
    vanished,
)
from airflow_nats_ordered.spark.task import TaskReport


class RunRefusedError(NatsOrderedError):
    """The run was recorded partial: refused rows (without allowRefused) or broken routing."""


def batch_run_id(producer_id: str, batch_id: int, query_id: str | None = None) -> str:
    """The run of one micro-batch of a streaming query: ``<producerId>.<query id>.batch-<id>``.

    ``query_id`` is the query's ``id`` (``StreamingQuery.id``, the task property
    ``sql.streaming.queryId``): kept in its checkpoint, the same on every restart from it and
    new for a new checkpoint, whose batch ids start at 0 again. Without it two queries with
    one ``producerId`` share run ids, and the second one's micro-batches are taken for the
    first one's, complete: nothing of them is stored. ``None`` gives the id without a query
    (``<producerId>.batch-<id>``, what versions before it wrote)."""
    if query_id is None:
        return f"{producer_id}.batch-{batch_id}"
    return f"{producer_id}.{query_id}.batch-{batch_id}"


@dataclass(frozen=True)
class RunPlan:
    """What the tasks of one run do: nothing (``complete``) or resume. ``previous``: the
    run's record before this attempt (each task resumes from it and from what the stream
    holds when it starts); ``resume``: where routed rows resumed when the job was planned."""

    run_id: str
    complete: bool = False
    resume: dict[int, PartitionResume] = field(default_factory=dict)
    attempt: int = 1
    previous: RunRecord | None = None
    #: a run new in the ledger: per partition, its last stream sequence when the job began;
    #: only the run's messages after it are this job's (anything before is a run forgotten
    #: on purpose, replayed in full)
    after: dict[int, int] = field(default_factory=dict)


async def plan_run(
    nc: NATS,
    stream: str,
    run_id: str,
    *,
    begin: bool,
    routed: bool = True,
    carried_over: bool = False,
) -> RunPlan:
    """Read the run's record; unless it is complete, ``begin`` marks it running. A routed
    run resumes after what the ledger recorded or the stream holds, whichever is further
    (a killed job records nothing)."""
    ledger = await RunLedger.open(nc, stream)
    previous = await ledger.get(run_id)
    if previous is not None and previous.status == "complete":
        return RunPlan(run_id, complete=True, attempt=previous.attempts)
    why = (
        refusal(previous, ledger.stream, routed=routed, carried_over=carried_over)
        if begin
        else None
    )
    if why is not None:  # begun on a layout the stream no longer has: see .repartitioned
        raise ConfigError(why)
    resume: dict[int, PartitionResume] = {}
    after: dict[int, int] = {}
    if routed:
        tails = await stored_tails(nc, stream, run_id)
        if previous is not None:
            resume = resume_points(previous, own_positions(tails))
        else:
            after = {p: t.seq for p, t in tails.items()}
    attempt = (previous.attempts if previous is not None else 0) + 1
    if begin:
        attempt = (await ledger.begin(run_id)).attempts
    return RunPlan(run_id, resume=resume, attempt=attempt, previous=previous, after=after)


def absorb_reports(
    rec: RunRecord,
    reports: Iterable[TaskReport | None],
    *,
    allow_refused: bool,
    error: str | None = None,
) -> list[int]:
    """Fold the tasks' reports into ``rec`` and set its status; returns the NATS partitions
    that more than one task published although the rows were routed (ids may collide)."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    refused: Counter[str] = Counter()
    examples: list[dict[str, Any]] = []
    accepted = acked_unrouted = failed = duplicates = skipped = 0
    any_unrouted = False
    for r in reports:
        if r is None or r.skipped_run:
            continue
        for p, s in r.partitions.items():
            if r.routed:
                if owner.setdefault(p, r.task) != r.task:
                    shared.add(p)
                rec.acked_per_partition[p] = s["offset"] + s["acked"]
                if p in r.digests:
                    rec.prefix_digests[p] = r.digests[p]
                skipped += s["offset"]
            else:
                any_unrouted = True
                acked_unrouted += s["acked"]
            if s["last_seq"]:
                rec.high_water_marks[p] = max(rec.high_water_marks.get(p, 0), s["last_seq"])
            accepted += s["accepted"]
            failed += s["failed"]
            duplicates += s["duplicates"]
        refused.update(r.refused)
        examples.extend(r.refused_examples)
    rec.accepted, rec.failed, rec.duplicates, rec.skipped = accepted, failed, duplicates, skipped
    rec.acked = acked_unrouted if any_unrouted else sum(rec.acked_per_partition.values())
    rec.refused = sum(refused.values())
    rec.refused_reasons = dict(refused)
    rec.refused_examples = examples[:REFUSED_EXAMPLES]
    rec.finished = time.time()
    if shared and error is None:
        error = (
            f"NATS partition(s) {sorted(shared)} were published by more than one Spark task "
            "although the rows carried a nats_partition column: positions (and so msg-ids) "
            "restarted in each task. Route with airflow_nats_ordered.spark.write_ordered "
            "(or route()), which puts each NATS partition in one task, and publish under a "
            "new producerId: the rows this run stored there are not the routed order, so "
            "the same producerId cannot resume them"
        )
    elif rec.refused and not allow_refused and error is None:
        shown = "; ".join(f"{e['where']}: {e['reason']}" for e in rec.refused_examples)
        error = (
            f"{rec.refused} rows were refused before sending ({shown}); set option "
            "allowRefused=true to publish the rest and succeed (a re-run with the same "
            "producerId resumes), or fix the input (the keyColumn must be set and not empty, "
            "each row small enough) and publish it under a new producerId: a run resumes only "
            "the input it started with"
        )
    rec.error = error
    rec.status = "complete" if error is None and failed == 0 else "partial"
    return sorted(shared)


async def record_run(
    nc: NATS,
    options: SinkOptions,
    run_id: str,
    reports: Iterable[TaskReport | None],
    *,
    error: str | None = None,
    unless_finished_after: float | None = None,
    resume: Mapping[int, PartitionResume] | None = None,
    from_stream: bool = False,
    seq_before: int | None = None,
) -> RunRecord:
    """Record the run's result in the ledger and return it.

    ``unless_finished_after``: leave a record already finished after this time alone (a
    ``commit()`` that refused the run wrote it; Spark then calls ``abort()`` too).
    ``resume``: where the run resumed (routed rows): a partition stored before that no task
    has rows of now means the input changed, and the run is not complete.
    ``from_stream``: count, per partition whose last message is the run's, what the stream
    holds (an aborted job's failed and cancelled tasks report nothing, but stored rows).
    ``seq_before``: unrouted rows, the stream's last sequence before the attempt began: its
    ``duplicates`` are the rows acknowledged minus the messages stored since (tasks share NATS
    partitions, so a task's own count of them is hidden by the others' stores).
    """
    reports = list(reports)
    ledger = await RunLedger.open(nc, options.stream)
    rec = await ledger.get(run_id)
    if rec is None:  # a micro-batch (not begun by the driver) or a ledger reset meanwhile
        rec = RunRecord(run_id, options.stream, ledger.stream.created, started=time.time())
        rec.attempts = 1
    elif unless_finished_after is not None and (rec.finished or 0) >= unless_finished_after:
        return rec
    elif rec.status != "running":
        rec.attempts += 1  # a micro-batch replayed (not begun by the driver)
    if error is None and resume:
        seen = {p for r in reports if r is not None and r.routed for p in r.partitions}
        error = vanished(resume, seen, run_id)
    absorb_reports(rec, reports, allow_refused=options.allow_refused, error=error)
    if seq_before is not None:
        with contextlib.suppress(Exception):  # the result is recorded whatever the count says
            stored = await last_seq(nc, options.stream) - seq_before
            rec.duplicates = max(0, rec.acked - stored)
    if from_stream:
        tails = {}
        with contextlib.suppress(Exception):  # the failure is recorded whatever the stream says
            tails = await stored_tails(nc, options.stream, run_id)
        for p, t in tails.items():
            if t.position > rec.acked_per_partition.get(p, 0):
                rec.acked_per_partition[p] = t.position
                raise_marks(rec, {p: t.seq})
        rec.acked = sum(rec.acked_per_partition.values())
    # every partition the run stored on has a mark (one whose task was not re-run, or whose
    # task's publisher could not read its last sequence, is marked at its last message),
    # else the run is not complete: a drain on its marks would not wait for that partition
    unmarked = await fill_marks(nc, ledger.stream, rec)
    if unmarked and rec.status == "complete":
        rec.status, rec.error = "partial", unmarked_error(unmarked)
    await ledger.record(rec)
    return rec
