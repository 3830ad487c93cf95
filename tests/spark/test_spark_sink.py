"""The ``nats-ordered`` Spark sink against a real nats-server, in one shared SparkSession."""

from __future__ import annotations

import json
import time

import pytest
from spark_helpers import exactly_once_in_order, make_stream, run_record, stored

from airflow_nats_ordered.core.stream.partitioning import partition_for

pytest.importorskip("pyspark")

from pyspark.sql import functions as F  # noqa: E402

from airflow_nats_ordered.spark import (  # noqa: E402
    PARTITION_COLUMN,
    partition_column,
    route,
    write_ordered,
)

AWKWARD = [
    "",
    "a",
    "ab",
    "abc",
    "abcd",
    "abcde",
    "N14228",
    "é",
    "日本語のキー",
    "emoji-🚀",
    " spaced key ",
    "x" * 1001,
    "\u0000nul",
]


def _rows(n: int, keys: int) -> list[dict]:
    # ts is unique, so the order per key is total; "i" numbers the rows
    return [{"k": f"key-{(i * 7) % keys}", "ts": 1_000 + i, "i": i} for i in range(n)]


def _df(spark, rows: list[dict], slices: int = 3):
    return spark.createDataFrame(rows, "k string, ts long, i long").repartition(slices)


def test_routing_column_equals_core_partition_for_on_awkward_keys(spark):
    df = spark.createDataFrame([(k,) for k in AWKWARD], "k string")
    for p in (1, 7, 16):
        got = dict(df.select("k", partition_column("k", p).alias("p")).rdd.map(tuple).collect())
        assert got == {k: partition_for(k, p) for k in AWKWARD}, p
    # Spark's own hash() is a different function: it would route some keys elsewhere
    theirs = df.select("k", F.pmod(F.hash("k"), F.lit(16)).alias("p")).collect()
    assert any(r.p != partition_for(r.k, 16) for r in theirs)


def test_write_ordered_stores_every_row_once_in_order_and_records_the_run(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=4)
    rows = _rows(3000, 37)
    rec = write_ordered(
        _df(spark, rows),
        stream=unique_name,
        key="k",
        order_by="ts",
        producer_id="job-1",
        connection={"url": nats_url},
    )
    got = stored(nats_url, unique_name)
    assert exactly_once_in_order(rows, got, "k", "ts") == []
    # per partition, the stream is the partition's rows in (ts) order: positions are ranks
    for p in range(4):
        mine = [s for s in got if s.subject.endswith(f".p.{p}")]
        want = sorted((r for r in rows if partition_for(r["k"], 4) == p), key=lambda r: r["ts"])
        assert [json.loads(s.data)["i"] for s in mine] == [r["i"] for r in want]
    assert rec.status == "complete" and rec.acked == 3000 and rec.refused == 0
    last = {}
    for s in got:
        last[int(s.subject.rsplit(".", 1)[1])] = s.seq
    assert rec.high_water_marks == last
    assert rec.acked_per_partition == {
        p: sum(1 for r in rows if partition_for(r["k"], 4) == p) for p in range(4)
    }
    # the same run again: complete in the ledger, nothing computed or sent
    again = write_ordered(
        _df(spark, rows),
        stream=unique_name,
        key="k",
        order_by="ts",
        producer_id="job-1",
        connection={"url": nats_url},
    )
    assert again.attempts == rec.attempts and len(stored(nats_url, unique_name)) == 3000


def _fail_first_attempts_once_stored(url: str, stream: str, after: int):
    """A pass-through ``mapInArrow`` step: the first attempt of every task raises once it
    has handed on ``after`` batches and the stream holds some of them (published by the
    writer downstream in the same task)."""

    def step(batches):
        import asyncio

        import nats
        from pyspark import TaskContext

        async def count() -> int:
            nc = await nats.connect(url)
            try:
                return (await nc.jetstream().stream_info(stream)).state.messages
            finally:
                await nc.close()

        tc = TaskContext.get()
        for n, b in enumerate(batches):
            if n == after and tc.attemptNumber() == 0:
                deadline = time.monotonic() + 120
                while asyncio.run(count()) == 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                raise RuntimeError("injected failure after publishing part of the task")
            yield b

    return step


def test_a_task_failing_after_publishing_part_of_its_rows_is_retried_without_duplicates(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=2)
    # ~250 bytes a row: Spark hands rows to the writer in 64 KiB buffers
    rows = [{**r, "pad": "x" * 200} for r in _rows(4000, 50)]
    df = spark.createDataFrame(rows, "k string, ts long, i long, pad string").repartition(3)
    routed = route(df, key="k", partitions=2, order_by=["ts"], tasks=2)
    failing = routed.mapInArrow(
        _fail_first_attempts_once_stored(nats_url, unique_name, 6), routed.schema
    )
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        (
            failing.write.format("nats-ordered")
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("orderBy", "ts")
            .option("producerId", "retried")
            .option("url", nats_url)
            .mode("append")
            .save()
        )
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = stored(nats_url, unique_name)
    assert exactly_once_in_order(rows, got, "k", "ts") == []
    rec = run_record(nats_url, unique_name, "retried")
    assert rec is not None and rec.status == "complete" and rec.acked == 4000
    # the failed attempt had stored rows: the retry passed over them (read from the stream,
    # so it holds past the duplicate window too) instead of re-sending them
    assert rec.skipped > 0, rec.to_dict()


def test_rows_out_of_declared_order_fail_the_task_before_they_are_sent(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=2)
    rows = [{"k": "one-key", "ts": t, "i": i} for i, t in enumerate([1, 2, 3, 5, 4, 6])]
    df = spark.createDataFrame(rows, "k string, ts long, i long").coalesce(1)
    with pytest.raises(Exception, match="write_ordered") as err:
        (
            df.write.format("nats-ordered")
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("orderBy", "ts")
            .option("producerId", "disordered")
            .option("url", nats_url)
            .mode("append")
            .save()
        )
    assert "ts=4 after ts=5" in str(err.value)
    # the whole batch was refused before sending: nothing out of order is in the stream
    assert stored(nats_url, unique_name) == []
    rec = run_record(nats_url, unique_name, "disordered")
    assert rec is not None and rec.status == "partial" and "aborted" in (rec.error or "")


def test_refused_rows_are_counted_and_fail_the_job_unless_allowed(spark, nats_url, unique_name):
    make_stream(nats_url, unique_name, partitions=2)
    rows = [{"k": None if i % 10 == 0 else f"k{i % 3}", "ts": i, "i": i} for i in range(50)]
    df = spark.createDataFrame(rows, "k string, ts long, i long")
    with pytest.raises(Exception, match="allowRefused"):
        write_ordered(
            df,
            stream=unique_name,
            key="k",
            order_by="ts",
            producer_id="strict",
            connection={"url": nats_url},
        )
    strict = run_record(nats_url, unique_name, "strict")
    assert strict is not None and strict.status == "partial"
    assert strict.refused == 5 and strict.refused_reasons == {"no key": 5}
    assert "allowRefused" in (strict.error or ""), strict.error  # commit's reason, kept
    assert strict.acked == 45
    ok = write_ordered(
        df,
        stream=unique_name,
        key="k",
        order_by="ts",
        producer_id="lenient",
        allow_refused=True,
        connection={"url": nats_url},
    )
    assert ok.status == "complete" and ok.refused == 5 and ok.acked == 45


def test_unrouted_tasks_sharing_a_partition_never_share_msg_ids(spark, nats_url, unique_name):
    make_stream(nats_url, unique_name, partitions=2)
    # identical rows in two Spark partitions: same key, payload and position in each task
    rows = [{"k": "same", "v": 1}] * 10
    df = spark.createDataFrame(rows, "k string, v long").repartition(2)
    assert min(df.rdd.glom().map(len).collect()) > 0  # both tasks hold the same rows
    (
        df.write.format("nats-ordered")
        .option("stream", unique_name)
        .option("keyColumn", "k")
        .option("producerId", "unrouted")
        .option("url", nats_url)
        .mode("append")
        .save()
    )
    got = stored(nats_url, unique_name)
    assert len(got) == 10 and len({s.msg_id for s in got}) == 10


def test_value_msg_id_and_headers_columns_are_sent_as_given(spark, nats_url, unique_name):
    make_stream(nats_url, unique_name, partitions=2)
    df = spark.createDataFrame(
        [("a", b"\x00raw", "id-1", {"x-trace": "t1"}), ("a", b"two", "id-2", {})],
        "k string, value binary, mid string, headers map<string,string>",
    ).coalesce(1)
    (
        df.write.format("nats-ordered")
        .option("stream", unique_name)
        .option("keyColumn", "k")
        .option("msgIdColumn", "mid")
        .option("producerId", "columns")
        .option("url", nats_url)
        .mode("append")
        .save()
    )
    got = stored(nats_url, unique_name)
    assert [(s.data, s.msg_id) for s in got] == [(b"\x00raw", "id-1"), (b"two", "id-2")]

    async def headers(nc):
        js = nc.jetstream()
        return (await js.get_msg(unique_name, got[0].seq)).headers

    from spark_helpers import on_server

    assert on_server(nats_url, headers)["x-trace"] == "t1"


def test_a_routing_column_is_kept_out_of_the_payload(spark):
    df = route(_df(spark, _rows(10, 3)), key="k", partitions=4, order_by=["ts"])
    assert PARTITION_COLUMN in df.columns
