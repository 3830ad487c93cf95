"""Spark follows the canonical key-text rule (issue 13 item 5): integral key columns route
and publish as their exact decimal text, binary columns as their UTF-8 text, null keys are
keyless (refused, counted); float/double/decimal/boolean/date/timestamp key columns are
refused before any job runs, naming the cast to use. One SparkSession for the run."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import pytest
from spark_helpers import make_stream, on_server, stored

from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.partitioning import partition_for

pytest.importorskip("pyspark")

from airflow_nats_ordered.core.errors import ConfigError  # noqa: E402
from airflow_nats_ordered.spark import route, write_ordered  # noqa: E402

P = 8
LONGS = [9223372036854775807, -9223372036854775808, -5, 0, 7, 10**12]


def test_integral_key_columns_route_exactly_like_their_decimal_text(spark):
    for typ in ("long", "int", "short", "byte"):
        values = [v for v in LONGS if -128 <= v <= 127] if typ == "byte" else LONGS
        if typ in ("int", "short"):
            limit = 2**31 if typ == "int" else 2**15
            values = [v for v in LONGS if -limit <= v < limit]
        df = spark.createDataFrame([(v,) for v in values], f"k {typ}")
        got = {r["k"]: r["nats_partition"] for r in route(df, key="k", partitions=P).collect()}
        assert got == {v: partition_for(str(v), P) for v in values}, typ


@pytest.mark.parametrize(
    ("typ", "value"),
    [
        ("double", 1.0),
        ("float", 3e-07),
        ("decimal(23,0)", decimal.Decimal(10**22)),
        ("boolean", True),
        ("date", dt.date(2024, 1, 2)),
        ("timestamp", dt.datetime(2024, 1, 2, 3)),
    ],
)
def test_a_key_column_without_one_text_is_refused_before_any_job_naming_the_cast(spark, typ, value):
    df = spark.createDataFrame([(value, 1)], f"k {typ}, v long")
    with pytest.raises(ConfigError) as err:
        write_ordered(df, stream="NOPE", key="k", producer_id="p")  # no server is asked
    msg = str(err.value)
    assert f"key column 'k' is {df.schema['k'].dataType.simpleString()}" in msg, msg
    assert "F.col('k').cast('string')" in msg


def test_write_ordered_publishes_integral_and_binary_keys_as_their_text(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, P)
    rows = [(v, i) for i, v in enumerate(LONGS)] + [(None, 99)]
    df = spark.createDataFrame(rows, "k long, i long")
    rec = write_ordered(
        df,
        stream=unique_name,
        key="k",
        producer_id="ints",
        order_by="i",
        allow_refused=True,
        connection={"url": nats_url},
    )
    assert rec.acked == len(LONGS) and rec.refused == 1  # the null key: keyless, refused
    got = stored(nats_url, unique_name)
    assert sorted(s.key for s in got) == sorted(str(v) for v in LONGS)
    for s in got:
        assert s.subject.endswith(f".p.{partition_for(s.key, P)}")
        payload = json.loads(s.data)
        assert str(payload["k"]) == s.key and set(payload) == {"k", "i"}  # no key-text column

    bdf = spark.createDataFrame([("Zürich".encode(), 1), (b" lead", 2)], "k binary, i long")
    write_ordered(
        bdf,
        stream=unique_name,
        key="k",
        producer_id="bin",
        order_by="i",
        connection={"url": nats_url},
    )

    async def keys_on_the_wire(nc):
        sub = await nc.jetstream().pull_subscribe(">", stream=unique_name)
        msgs = await sub.fetch(len(LONGS) + 2, timeout=30)
        return {(message_key(m.headers), m.subject) for m in msgs}

    on_wire = on_server(nats_url, keys_on_the_wire)
    for k in ("Zürich", " lead"):  # arrive as their text, on the partition of that text
        assert (k, f"{unique_name.lower()}.p.{partition_for(k, P)}") in on_wire, on_wire


def test_the_data_source_takes_integral_key_columns_and_refuses_floats_naming_keycolumn(
    spark, nats_url, unique_name
):
    """``df.write.format("nats-ordered")`` follows the same key-text rule as write_ordered:
    an integral keyColumn publishes each key as its digits, on that text's partition."""
    make_stream(nats_url, unique_name, P)
    df = spark.createDataFrame([(v, i) for i, v in enumerate(LONGS)], "k long, i long")

    def save(frame, producer_id):
        (
            frame.write.format("nats-ordered")
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("producerId", producer_id)
            .option("url", nats_url)
            .mode("append")
            .save()
        )

    save(df.coalesce(1), "longs")
    got = stored(nats_url, unique_name)
    assert sorted(s.key for s in got) == sorted(str(v) for v in LONGS)
    for s in got:
        assert s.subject.endswith(f".p.{partition_for(s.key, P)}")

    floats = spark.createDataFrame([(1.0, 1)], "k double, i long")
    with pytest.raises(Exception, match=r"keyColumn 'k' is double") as err:
        save(floats, "floats")
    assert "cast('string')" in str(err.value)
