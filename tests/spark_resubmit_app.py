"""A routed batch publish for tests/spark/test_spark_resubmit.py, run with spark-submit.

``spark_resubmit_app.py URL STREAM PRODUCER_ID ROWS [--slow] [--after-window]``: ROWS rows over
50 keys in ts order per key, routed over the stream's partitions into two tasks, published with
the ``nats-ordered`` data source (deliveryTimeout 1 s, so a short duplicate window is accepted).
``--slow`` pauses between Arrow batches, so that the job can be killed in the middle.
``--after-window`` begins the write only once the stream's newest message is older than its
duplicate window (spark_helpers.WINDOW): the JVM starts meanwhile, not after the wait.
"""

from __future__ import annotations

import sys
import time

from pyspark.sql import SparkSession

from airflow_nats_ordered.spark import register, route


def _slow(batches):
    for b in batches:
        time.sleep(0.3)
        yield b


def main(argv: list[str]) -> None:
    url, stream, producer, n = argv[0], argv[1], argv[2], int(argv[3])
    spark = SparkSession.builder.appName("spark-resubmit-test").getOrCreate()
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    register(spark)
    rows = [(f"key-{i % 50}", 1_000 + i, i, "x" * 200) for i in range(n)]
    df = spark.createDataFrame(rows, "k string, ts long, i long, pad string")
    routed = route(df, key="k", partitions=4, order_by=["ts"], tasks=2)
    if "--slow" in argv:
        routed = routed.mapInArrow(_slow, routed.schema)
    if "--after-window" in argv:
        from spark_helpers import wait_past_the_window  # beside this file, in tests/

        wait_past_the_window(url, stream)
    (
        routed.write.format("nats-ordered")
        .option("stream", stream)
        .option("keyColumn", "k")
        .option("orderBy", "ts")
        .option("producerId", producer)
        .option("deliveryTimeout", "1")
        .option("url", url)
        .mode("append")
        .save()
    )
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
