"""Structured Streaming into the nats-ordered sink across queries and restarts (issue 17,
items 4 to 6): a new checkpoint with the same producerId stores its rows; a micro-batch
replayed with another task layout stores nothing twice; orderBy is kept per key (routed per
micro-batch with ``ordered_batches``) or refused, never silently broken."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from spark_helpers import exactly_once_in_order, make_stream, on_server, stored

pytest.importorskip("pyspark")

SCHEMA = "k string, ts long, i long"


def _rows(first: int, n: int, keys: int = 7) -> list[dict[str, Any]]:
    return [{"k": f"key-{i % keys}", "ts": i, "i": i} for i in range(first, first + n)]


def _source(spark, folder: Path, *files: list[dict[str, Any]]):
    folder.mkdir()
    for n, rows in enumerate(files):
        (folder / f"part-{n}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return spark.readStream.schema(SCHEMA).json(str(folder))


def _sink(df, url: str, stream: str, checkpoint: Path, **options: str):
    w = (
        df.writeStream.format("nats-ordered")
        .option("stream", stream)
        .option("keyColumn", "k")
        .option("producerId", "events")
        .option("url", url)
        .option("checkpointLocation", str(checkpoint))
    )
    for k, v in options.items():
        w = w.option(k, v)
    return w.trigger(availableNow=True)


def _run(writer) -> Any:
    q = writer.start()
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    return q


def test_a_new_checkpoint_with_the_same_producer_id_stores_its_rows(
    spark, nats_url, unique_name, tmp_path
):
    """Item 4: query B (a fresh checkpoint, batch ids from 0 again) is not taken for query A:
    on the old code its run ids were A's, complete, and it stored 0 of its rows."""
    make_stream(nats_url, unique_name, partitions=2)
    a = _rows(0, 30)
    b = _rows(1000, 20)
    b.append(dict(b[-1]))  # two identical rows in one task: two records
    _run(_sink(_source(spark, tmp_path / "a", a), nats_url, unique_name, tmp_path / "chk-a"))
    _run(_sink(_source(spark, tmp_path / "b", b), nats_url, unique_name, tmp_path / "chk-b"))
    got = stored(nats_url, unique_name)
    assert exactly_once_in_order(a + b, got, "k", "ts") == []


def test_a_replay_with_another_task_layout_stores_nothing_twice(
    spark, nats_url, unique_name, tmp_path
):
    """Item 5: micro-batch 0 stored in 2 Spark tasks, its driver killed before the commit
    (the checkpoint has its offsets, no commit; the ledger has no record of it), replayed in
    3 tasks (another core count, another repartition): every row stored once. On the old code
    ids came from the task and the row's position in it, and the replay stored them again."""
    make_stream(nats_url, unique_name, partitions=2)
    rows = _rows(0, 90)
    src = tmp_path / "in"
    chk = tmp_path / "chk"
    df = _source(spark, src, rows)
    first = _run(_sink(df.repartition(2), nats_url, unique_name, chk))
    assert len(stored(nats_url, unique_name)) == len(rows)
    # what a driver killed after its tasks stored the micro-batch, before commit(), leaves
    for f in (chk / "commits").iterdir():
        f.unlink()

    async def forget_runs(nc: Any) -> None:
        kv = await nc.jetstream().key_value(f"nor_{unique_name}_runs")
        for k in await kv.keys():
            await kv.purge(k)

    on_server(nats_url, forget_runs)
    df = spark.readStream.schema(SCHEMA).json(str(src))
    second = _run(_sink(df.repartition(3), nats_url, unique_name, chk))
    assert second.id == first.id and second.lastProgress is not None
    assert second.lastProgress["batchId"] == 0, second.lastProgress  # batch 0 replayed
    got = stored(nats_url, unique_name)
    # no order is declared (round-robin repartition): every row once is the point here
    problems = [p for p in exactly_once_in_order(rows, got, "k", "ts") if "order" not in p]
    assert problems == [], f"{len(got)} stored of {len(rows)} rows"


def test_order_by_is_kept_per_micro_batch_or_refused(spark, nats_url, unique_name, tmp_path):
    """Item 6: one micro-batch in 2 Spark tasks (2 input files), each task's rows in order,
    with orderBy: the old sink stored it with keys out of order and recorded it complete.
    The sink refuses orderBy on unrouted rows, naming ordered_batches, which routes each
    micro-batch and keeps every key in order."""
    make_stream(nats_url, unique_name, partitions=2)
    rows = _rows(0, 80)
    # two files, each in ts order: two Spark tasks of one micro-batch, every key in both
    df = _source(spark, tmp_path / "in", rows[0::2], rows[1::2])
    error = ""
    try:
        q = _sink(df, nats_url, unique_name, tmp_path / "chk", orderBy="ts").start()
        q.awaitTermination(180)
        error = str(q.exception() or "")
    except Exception as exc:  # refused when the query starts
        error = str(exc)
    got = stored(nats_url, unique_name)
    assert "orderBy" in error and "ordered_batches" in error, (
        f"orderBy accepted: {len(got)} stored, {exactly_once_in_order(rows, got, 'k', 'ts')[:3]}"
    )
    assert got == []

    from airflow_nats_ordered.spark import ordered_batches

    fn = ordered_batches(
        stream=unique_name,
        key="k",
        order_by="ts",
        producer_id="events",
        connection={"url": nats_url},
    )
    q = (
        df.writeStream.foreachBatch(fn)
        .option("checkpointLocation", str(tmp_path / "chk-fb"))
        .trigger(availableNow=True)
    )
    _run(q)
    got = stored(nats_url, unique_name)
    assert exactly_once_in_order(rows, got, "k", "ts") == []
