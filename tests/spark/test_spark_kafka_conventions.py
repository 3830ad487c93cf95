"""The sink used as a Spark engineer uses Spark's Kafka sink: ``key``/``value``/``headers``
columns (headers as a map or as Kafka's array of key/value structs), save modes, header
values of the wrong type, a duplicate window too short for the delivery timeout, and the
run record's ``duplicates``/``attempts`` against what the stream holds."""

from __future__ import annotations

from typing import Any

import pytest
from spark_helpers import make_stream, on_server, run_record, stored

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

pytest.importorskip("pyspark")

from pyspark.sql import functions as F  # noqa: E402


def _messages(url: str, stream: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(key, payload, extra headers) of every message, in stream order."""

    async def read(nc: Any) -> list[tuple[str, bytes, dict[str, str]]]:
        js = nc.jetstream()
        last = (await js.stream_info(stream)).state.last_seq
        out = []
        for seq in range(1, last + 1):
            m = await js.get_msg(stream, seq)
            h = dict(m.headers or {})
            key = h.pop("Nats-Ordered-Key", "")
            extra = {k: v for k, v in h.items() if not k.startswith("Nats-")}
            out.append((key, m.data or b"", extra))
        return out

    return on_server(url, read)


def _writer(df: Any, stream: str, url: str, producer: str) -> Any:
    return (
        df.write.format("nats-ordered")
        .option("stream", stream)
        .option("producerId", producer)
        .option("url", url)
    )


def test_key_value_and_headers_columns_as_in_kafkas_sink(spark, nats_url, unique_name):
    """No keyColumn: the key is the column ``key``; ``value`` is the payload; ``headers``
    is a map or Kafka's ``array<struct<key:string,value:binary>>``."""
    make_stream(nats_url, unique_name, partitions=2)
    df = spark.createDataFrame(
        [("a", "v1", {"h": "1"}), ("b", "v2", None)],
        "key string, value string, headers map<string,string>",
    ).coalesce(1)
    _writer(df, unique_name, nats_url, "as-map").mode("append").save()
    kafka = spark.createDataFrame(
        [("c", b"v3", [("trace", b"t-1"), ("origin", b"spark")]), ("d", b"v4", [])],
        "key string, value binary, headers array<struct<key:string,value:binary>>",
    ).coalesce(1)
    _writer(kafka, unique_name, nats_url, "as-kafka").mode("append").save()
    got = sorted(_messages(nats_url, unique_name))
    assert got == [
        ("a", b"v1", {"h": "1"}),
        ("b", b"v2", {}),
        ("c", b"v3", {"trace": "t-1", "origin": "spark"}),
        ("d", b"v4", {}),
    ]
    for run in ("as-map", "as-kafka"):
        rec = run_record(nats_url, unique_name, run)
        assert rec is not None and rec.status == "complete" and rec.acked == 2, run


def test_without_a_key_column_the_error_names_keycolumn_and_the_default(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=2)
    df = spark.createDataFrame([("a", 1)], "tail string, n int")
    with pytest.raises(Exception, match="keyColumn") as err:
        _writer(df, unique_name, nats_url, "no-key").mode("append").save()
    assert "'key'" in str(err.value) and "tail, n" in str(err.value)
    assert run_record(nats_url, unique_name, "no-key") is None


@pytest.mark.parametrize(
    "headers, typ",
    [
        ("map('h', 1)", "map<string,int>"),
        (
            "array(named_struct('key', 'h', 'value', 1.5d))",
            "array<struct<key:string,value:double>>",
        ),
    ],
)
def test_header_values_of_another_type_are_refused_before_the_run_begins(
    spark, nats_url, unique_name, headers, typ
):
    make_stream(nats_url, unique_name, partitions=2)
    df = spark.createDataFrame([("a", "v")], "key string, value string").withColumn(
        "headers", F.expr(headers)
    )
    with pytest.raises(Exception, match="'headers' holds message headers") as err:
        _writer(df, unique_name, nats_url, "bad-type").mode("append").save()
    text = str(err.value)
    assert typ in text and "map<string,string>" in text and "Nothing was sent" in text
    assert stored(nats_url, unique_name) == []
    assert run_record(nats_url, unique_name, "bad-type") is None  # not begun


def test_null_non_utf8_and_repeated_header_values_refuse_their_row_not_the_task(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=2)
    df = spark.createDataFrame(
        [
            ("ok", "1", [("h", b"x")]),
            ("null", "2", [("h", None)]),
            ("bytes", "3", [("h", b"\xff\xfe")]),
            ("twice", "4", [("h", b"1"), ("h", b"2")]),
        ],
        "key string, value string, headers array<struct<key:string,value:binary>>",
    ).coalesce(1)
    with pytest.raises(Exception, match="allowRefused"):
        _writer(df, unique_name, nats_url, "strict").mode("append").save()
    rec = run_record(nats_url, unique_name, "strict")
    assert rec is not None and rec.status == "partial" and rec.refused == 3, rec
    reasons = " ".join(e["message"] for e in rec.refused_examples)
    assert "header 'h' is null" in reasons and "not UTF-8" in reasons and "twice" in reasons
    _writer(df, unique_name, nats_url, "lenient").option("allowRefused", "true").mode(
        "append"
    ).save()
    rec = run_record(nats_url, unique_name, "lenient")
    assert rec is not None and rec.status == "complete" and rec.refused == 3
    assert [m[0] for m in _messages(nats_url, unique_name)] == ["ok", "ok"]


def test_save_modes_other_than_append_are_refused_naming_append(spark, nats_url, unique_name):
    make_stream(nats_url, unique_name, partitions=2)
    df = spark.createDataFrame([("a", "v")], "key string, value string")
    # Spark's default (ErrorIfExists) and Ignore are refused by Spark itself for a Python
    # data source, before the source is asked; overwrite by the sink: both name Append
    write = _writer(df, unique_name, nats_url, "modes").option("keyColumn", "key")
    with pytest.raises(Exception, match='"Append"'):
        write.save()
    with pytest.raises(Exception, match=r'cannot overwrite it; use \.mode\("append"\)'):
        write.mode("overwrite").save()
    assert run_record(nats_url, unique_name, "modes") is None
    write.mode("append").save()
    assert len(stored(nats_url, unique_name)) == 1


def test_a_duplicate_window_shorter_than_the_resend_time_is_refused_at_writer_creation(
    spark, nats_url, unique_name
):
    on_server(
        nats_url,
        lambda nc: provision(nc, StreamSpec(unique_name, partitions=2, duplicate_window=30)),
    )
    df = spark.createDataFrame([("a", "v"), ("b", "w")], "key string, value string")
    with pytest.raises(Exception, match="deliveryTimeout") as err:
        _writer(df, unique_name, nats_url, "window").mode("append").save()
    text = str(err.value)
    assert "not set (default 120s)" in text and "for 30s only" in text
    assert '.option("deliveryTimeout", "24")' in text and "--duplicate-window 126s" in text
    with pytest.raises(Exception, match="option deliveryTimeout is 60s"):
        _writer(df, unique_name, nats_url, "window").option("deliveryTimeout", "60").mode(
            "append"
        ).save()
    with pytest.raises(Exception, match="must be a number of seconds > 0"):
        _writer(df, unique_name, nats_url, "window").option("deliveryTimeout", "soon").mode(
            "append"
        ).save()
    # the run was never begun: the write that works is its first attempt
    assert run_record(nats_url, unique_name, "window") is None
    _writer(df, unique_name, nats_url, "window").option("deliveryTimeout", "20").mode(
        "append"
    ).save()
    rec = run_record(nats_url, unique_name, "window")
    assert rec is not None and rec.status == "complete" and rec.attempts == 1, rec


def _hold_task(url: str, stream: str, task: int, until: int, then_fail: bool):
    """A pass-through ``mapInArrow`` step: Spark partition ``task`` hands on nothing until the
    stream holds ``until`` messages (published by the other task's writer), then raises
    (``then_fail``: every attempt, so the job is aborted) or hands on its rows."""

    def step(batches):
        import asyncio
        import time

        import nats
        from pyspark import TaskContext

        async def count() -> int:
            nc = await nats.connect(url)
            try:
                return (await nc.jetstream().stream_info(stream)).state.messages
            finally:
                await nc.close()

        if TaskContext.get().partitionId() == task:
            deadline = time.monotonic() + 60
            while asyncio.run(count()) < until and time.monotonic() < deadline:
                time.sleep(0.05)
            if then_fail:
                raise RuntimeError(f"injected failure of Spark partition {task}")
        yield from batches

    return step


def test_a_rerun_counts_as_duplicates_exactly_the_rows_the_stream_already_held(
    spark, nats_url, unique_name
):
    """Unrouted rows: both tasks publish to both NATS partitions, so a task's own count of
    the stream (before and after) includes the other task's new rows. Attempt 1 stores Spark
    partition 0's rows and fails on partition 1; attempt 2 re-sends partition 0's rows while
    partition 1's are stored: ``duplicates`` must be exactly partition 0's rows."""
    make_stream(nats_url, unique_name, partitions=2)
    rows = [(f"k{i % 20}", i, "x" * 100) for i in range(800)]
    df = spark.createDataFrame(rows, "k string, i long, pad string").coalesce(2)
    n0, n1 = df.rdd.glom().map(len).collect()

    def write(frame: Any) -> None:
        _writer(frame, unique_name, nats_url, "rerun").option("keyColumn", "k").mode(
            "append"
        ).save()

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "50")
    try:
        with pytest.raises(Exception, match="injected failure"):
            write(df.mapInArrow(_hold_task(nats_url, unique_name, 1, n0, True), df.schema))
        assert len(stored(nats_url, unique_name)) == n0
        rec = run_record(nats_url, unique_name, "rerun")
        assert rec is not None and rec.status == "partial" and rec.attempts == 1
        # partition 0 re-sends its rows only once partition 1 is storing its own
        write(df.mapInArrow(_hold_task(nats_url, unique_name, 0, n0 + n1 // 2, False), df.schema))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert len(stored(nats_url, unique_name)) == len(rows)
    rec = run_record(nats_url, unique_name, "rerun")
    assert rec is not None and rec.status == "complete" and rec.attempts == 2
    assert (rec.acked, rec.duplicates) == (len(rows), n0), rec.to_dict()
