"""A Spark write whose binary key column holds a key that is not UTF-8 (issue 28 item 10):
with allowRefused the row is refused, counted and the run recorded ``complete``; the commit
used to fail on the refusal's example (``Object of type bytes is not JSON serializable``)
and leave the ledger ``running`` with the other rows stored. One SparkSession for the run."""

from __future__ import annotations

import base64

import pytest
from spark_helpers import make_stream, run_record, stored

pytest.importorskip("pyspark")

ROWS = [(b"a", 1), (b"\xff\xfebad", 2), (b"b", 3)]


def test_a_binary_key_that_is_not_utf8_is_refused_and_the_run_recorded_complete(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, 2)
    df = spark.createDataFrame(ROWS, "k binary, i long").coalesce(1)
    (
        df.write.format("nats-ordered")
        .option("stream", unique_name)
        .option("keyColumn", "k")
        .option("producerId", "bin")
        .option("allowRefused", "true")
        .option("url", nats_url)
        .mode("append")
        .save()
    )
    rec = run_record(nats_url, unique_name, "bin")
    assert rec is not None and rec.status == "complete", rec
    assert rec.acked == 2 and rec.refused == 1 and rec.refused_reasons == {"bad key": 1}
    (example,) = rec.refused_examples
    assert example["key"] is None and base64.b64decode(example["key_b64"]) == b"\xff\xfebad"
    assert sorted(s.key for s in stored(nats_url, unique_name)) == ["a", "b"]
