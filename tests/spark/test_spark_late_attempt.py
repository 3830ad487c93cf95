"""A task retry whose failed attempt stores rows *after* the retry read the stream.

CI found it (test_spark_resume's late retry: 299 rows stored twice): a failed attempt's
last rows land after its retry read the partitions' tails, and the retry, sending past the
duplicate window, stored them again. The retry's first row per partition now expects the
tail it read (the core publisher's fence), so it learns what was stored since and passes
over it. The tasks run through ``publish_task`` (what the data source's ``write`` runs in
each task), the failed attempt inside the retry's first read of its input: the schedule is
the same on every run.
"""

from __future__ import annotations

import asyncio

import nats
import pyarrow as pa
from spark_helpers import WINDOW, on_server, stored, wait_past_the_window

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.spark.options import PARTITION_COLUMN, SinkOptions
from airflow_nats_ordered.spark.runs import plan_run
from airflow_nats_ordered.spark.task import publish_task

P = 2
NAMES = ["key", "value", "ts", PARTITION_COLUMN]


def _rows(n: int) -> list[dict]:
    rows = [{"key": f"k{i % 10}", "value": f"v{i}", "ts": i} for i in range(n)]
    # a routed task's input: partition by partition, each sorted by the write's order
    return sorted(rows, key=lambda r: (partition_for(r["key"], P), r["ts"]))


def _batches(rows: list[dict], size: int = 50) -> list[pa.RecordBatch]:
    return [
        pa.RecordBatch.from_pydict(
            {
                "key": [r["key"] for r in part],
                "value": [r["value"].encode() for r in part],
                "ts": [r["ts"] for r in part],
                PARTITION_COLUMN: [partition_for(r["key"], P) for r in part],
            }
        )
        for part in (rows[i : i + size] for i in range(0, len(rows), size))
    ]


def test_rows_a_failed_attempt_stored_after_its_retry_read_the_stream_are_stored_once(
    nats_url, unique_name
):
    on_server(
        nats_url,
        lambda nc: provision(nc, StreamSpec(unique_name, partitions=P, duplicate_window=WINDOW)),
    )
    rows = _rows(400)
    options = SinkOptions.from_spark(
        {
            "stream": unique_name,
            "producerId": "late",
            "url": nats_url,
            "orderBy": "ts",
            "deliveryTimeout": "1",
        },
        env={},
    )

    async def go():
        nc = await nats.connect(nats_url)
        try:
            plan = await plan_run(nc, unique_name, "late", begin=True, routed=True)
            at_start = {p: r.count for p, r in plan.resume.items()}

            async def attempt(conn, n: int, batches) -> None:
                await publish_task(
                    conn,
                    options,
                    batches,
                    schema_names=NAMES,
                    run_producer_id=plan.run_id,
                    previous=plan.previous,
                    after=plan.after,
                    stored_at_start=at_start,
                    task=0,
                    attempt=n,
                    label=f"Spark partition 0 (attempt {n})",
                )

            def retry_input():
                # the retry has read the tails (nothing stored); now the failed attempt's
                # rows land (its first 250, on a connection of its own), and the retry's
                # input comes after the window
                async def failed_attempt() -> None:
                    nc2 = await nats.connect(nats_url)
                    try:
                        await attempt(nc2, 0, iter(_batches(rows[:250])))
                    finally:
                        await nc2.close()

                asyncio.run(failed_attempt())
                wait_past_the_window(nats_url, unique_name)
                yield from _batches(rows)

            await attempt(nc, 1, retry_input())
        finally:
            await nc.close()

    asyncio.run(go())
    have = stored(nats_url, unique_name)
    assert len(have) == len(rows), f"{len(have) - len(rows)} rows stored twice"
    got = [(s.key, int(s.data.decode()[1:])) for s in have]
    assert sorted(ts for _, ts in got) == [r["ts"] for r in sorted(rows, key=lambda r: r["ts"])]
    per_key: dict[str, list[int]] = {}
    for key, ts in got:
        per_key.setdefault(key, []).append(ts)
    assert all(v == sorted(v) for v in per_key.values()), per_key
