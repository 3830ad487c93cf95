"""A streaming write's run record against what the stream holds, and what is refused when
the query starts (before a micro-batch is begun or sent)."""

from __future__ import annotations

import json

import pytest
from spark_helpers import on_server, run_record, stored

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import batch_run_id  # noqa: E402

ROWS = 300


def _source(spark, tmp_path, copies: int):
    """One micro-batch of ``copies`` files (a Spark task each) holding the same rows."""
    src = tmp_path / "in"
    src.mkdir()
    rows = [{"k": f"key-{i % 13}", "i": i, "pad": "x" * 200} for i in range(ROWS)]
    for f in range(copies):
        (src / f"part-{f}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return spark.readStream.schema("k string, i long, pad string").json(str(src))


def _run(df, stream: str, url: str, checkpoint, **options: str) -> str:
    q = (
        df.writeStream.format("nats-ordered")
        .option("stream", stream)
        .option("keyColumn", "k")
        .option("producerId", "events")
        .option("url", url)
        .option("checkpointLocation", str(checkpoint))
        .options(**options)
        .trigger(availableNow=True)
        .start()
    )
    try:
        q.awaitTermination(120)
    finally:
        q.stop()
    return str(q.id)


def test_identical_rows_in_two_tasks_are_counted_as_duplicates(
    spark, nats_url, unique_name, tmp_path
):
    """The two tasks of the micro-batch publish the same rows (same msg-ids: the ids come
    from the rows) to the same NATS partitions at once: the stream stores each once and the
    run record counts the other copy as a duplicate, however the tasks interleave."""
    on_server(nats_url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=2)))
    qid = _run(_source(spark, tmp_path, 2), unique_name, nats_url, tmp_path / "chk")
    assert len(stored(nats_url, unique_name)) == ROWS
    rec = run_record(nats_url, unique_name, batch_run_id("events", 0, qid))
    assert rec is not None and rec.status == "complete", rec
    assert (rec.acked, rec.duplicates, rec.attempts) == (2 * ROWS, ROWS, 1), rec.to_dict()


def test_a_window_shorter_than_the_resend_time_fails_the_query_at_its_start(
    spark, nats_url, unique_name, tmp_path
):
    on_server(
        nats_url,
        lambda nc: provision(nc, StreamSpec(unique_name, partitions=2, duplicate_window=30)),
    )
    with pytest.raises(Exception, match="deliveryTimeout") as err:
        _run(_source(spark, tmp_path, 1), unique_name, nats_url, tmp_path / "chk")
    assert "for 30s only" in str(err.value)
    assert stored(nats_url, unique_name) == []
