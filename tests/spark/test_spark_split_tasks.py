"""A NATS partition whose rows are in two Spark tasks of one job, in the schedule where one
task runs after the other has stored rows: the second sees the first's rows as already
stored. It must say so (split over tasks), not that the input changed.

Found by a loaded CI run: ``test_a_partition_split_over_sorted_tasks...`` got "its input
changed" when Spark ran the two tasks one after the other. The tasks are run here through
``publish_task`` (what the data source's ``write`` runs in each task) in that order, so the
schedule is the same on every run.
"""

from __future__ import annotations

import asyncio

import nats
import pyarrow as pa
import pytest
from spark_helpers import make_stream, stored

from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.spark.options import PARTITION_COLUMN, SinkOptions
from airflow_nats_ordered.spark.resume import InputChangedError
from airflow_nats_ordered.spark.runs import plan_run
from airflow_nats_ordered.spark.task import publish_task

P = 4


def _batch(keys: list[str], start: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "key": keys,
            "value": [f"v{start + i}".encode() for i in range(len(keys))],
            PARTITION_COLUMN: [partition_for(k, P) for k in keys],
        }
    )


def test_the_second_task_of_a_split_partition_names_the_split_not_changed_input(
    nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=P)
    keys = [f"k{i}" for i in range(40)]
    target = partition_for(keys[0], P)
    mine = [k for k in keys if partition_for(k, P) == target]
    assert len(mine) >= 4, mine
    half = len(mine) // 2
    options = SinkOptions.from_spark(
        {"stream": unique_name, "producerId": "split", "url": nats_url}, env={}
    )
    names = ["key", "value", PARTITION_COLUMN]

    async def go() -> tuple[str, int]:
        nc = await nats.connect(nats_url)
        try:
            plan = await plan_run(nc, unique_name, "split", begin=True, routed=True)
            at_start = {p: r.count for p, r in plan.resume.items()}

            async def task(n: int, rows: list[str]) -> None:
                await publish_task(
                    nc,
                    options,
                    iter([_batch(rows, n * 100)]),
                    schema_names=names,
                    run_producer_id=plan.run_id,
                    previous=plan.previous,
                    after=plan.after,
                    stored_at_start=at_start,
                    task=n,
                    attempt=0,
                    label=f"Spark partition {n} (attempt 0)",
                )

            await task(0, mine[:half])  # the first task stores its rows of the partition
            try:
                await task(1, mine[half:])  # the second has other rows of the same one
            except InputChangedError as exc:
                return str(exc), half
            pytest.fail("the second task of a split partition was not refused")
        finally:
            await nc.close()

    err, first = asyncio.run(go())
    assert "more than one Spark task" in err and "write_ordered" in err, err
    assert "new producerId" in err, err
    assert "input changed" not in err, err
    # refused before sending: only the first task's rows are stored
    assert len(stored(nats_url, unique_name)) == first
