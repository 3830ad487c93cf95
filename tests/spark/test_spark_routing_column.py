"""A ``nats_partition`` column that is not the stream's routing is refused in the writer before
anything is sent, and the fix its message names then stores every row once, in order, with
the same producerId (issue 17 item 3)."""

from __future__ import annotations

import pytest
from spark_helpers import exactly_once_in_order, make_stream, run_record, stored

pytest.importorskip("pyspark")

from pyspark.sql import functions as F  # noqa: E402

from airflow_nats_ordered.spark import PARTITION_COLUMN, partition_column, write_ordered  # noqa: E402

P = 4


def _rows(n: int = 200, keys: int = 40) -> list[dict]:
    return [{"k": f"key-{(i * 7) % keys}", "ts": 1_000 + i, "i": i} for i in range(n)]


def _sink(df, url: str, stream: str, producer: str) -> None:
    (
        df.write.format("nats-ordered")
        .option("stream", stream)
        .option("keyColumn", "k")
        .option("orderBy", "ts")
        .option("producerId", producer)
        .option("url", url)
        .mode("append")
        .save()
    )


def _error(write) -> str:
    try:
        write()
    except Exception as exc:
        return str(exc)
    raise AssertionError("the write succeeded")


def _follow_the_message(spark, url, stream, rows, producer, err: str) -> None:
    """What the refused write stored, then write_ordered with the same producerId: every row
    once, each key in order (the old code: rows sent, then stored twice, keys out of order)."""
    sent = len(stored(url, stream))
    df = spark.createDataFrame(rows, "k string, ts long, i long")
    rec = write_ordered(
        df, stream=stream, key="k", order_by="ts", producer_id=producer, connection={"url": url}
    )
    problems = exactly_once_in_order(rows, stored(url, stream), "k", "ts")
    assert (sent, problems) == (0, []), f"sent before the refusal: {sent}; {err:.300}"
    assert rec.status == "complete" and rec.acked == len(rows)


def test_a_partition_column_computed_with_sparks_hash_is_refused_before_sending(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=P)
    rows = _rows()
    df = spark.createDataFrame(rows, "k string, ts long, i long")
    # the user's own routing column, grouped and sorted like route()'s, but with Spark's hash
    mine = (
        df.withColumn(PARTITION_COLUMN, F.pmod(F.hash("k"), F.lit(P)))
        .repartition(2, PARTITION_COLUMN)
        .sortWithinPartitions(PARTITION_COLUMN, "ts")
    )
    err = _error(lambda: _sink(mine, nats_url, unique_name, "own-column"))
    rec = run_record(nats_url, unique_name, "own-column")
    assert rec is not None and rec.status == "partial"
    _follow_the_message(spark, nats_url, unique_name, rows, "own-column", err)
    assert "but the stream routes that key to partition" in err, err[-2000:]
    assert f"column '{PARTITION_COLUMN}'" in err and "write_ordered" in err


def test_a_right_column_whose_partitions_are_split_over_tasks_is_refused_before_sending(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=P)
    rows = _rows()
    df = spark.createDataFrame(rows, "k string, ts long, i long")
    # the right values, but the rows were never put partition by partition into tasks
    # (each task's rows are in ts order, so no partition receives them out of order)
    mine = (
        df.withColumn(PARTITION_COLUMN, partition_column("k", P))
        .repartition(2)
        .sortWithinPartitions("ts")
    )
    err = _error(lambda: _sink(mine, nats_url, unique_name, "split"))
    _follow_the_message(spark, nats_url, unique_name, rows, "split", err)
    assert "partition by partition" in err and "write_ordered" in err, err[-2000:]


def test_a_partition_split_over_sorted_tasks_fails_the_run_and_is_not_resumed_silently(
    spark, nats_url, unique_name
):
    """Right values, each task sorted by them, but a NATS partition in both tasks: found at
    commit (the tasks cannot see each other), after rows were stored. The same producerId
    then cannot resume (those rows are not the routed order): refused, not stored twice."""
    make_stream(nats_url, unique_name, partitions=P)
    rows = _rows()
    df = spark.createDataFrame(rows, "k string, ts long, i long")
    mine = (
        df.withColumn(PARTITION_COLUMN, partition_column("k", P))
        .repartition(2)
        .sortWithinPartitions(PARTITION_COLUMN, "ts")
    )
    err = _error(lambda: _sink(mine, nats_url, unique_name, "shared"))
    sent = len(stored(nats_url, unique_name))
    try:
        write_ordered(
            df,
            stream=unique_name,
            key="k",
            order_by="ts",
            producer_id="shared",
            connection={"url": nats_url},
        )
        again = ""
    except Exception as exc:
        again = str(exc)
    more = len(stored(nats_url, unique_name)) - sent
    assert more == 0, f"the same producerId stored {more} more rows after {sent}: {err:.300}"
    assert "more than one Spark task" in err and "new producerId" in err, err[-2000:]
    assert "input changed" in again, again[-2000:]
