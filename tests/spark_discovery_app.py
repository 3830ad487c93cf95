"""``format("nats-ordered")`` without ``register()``, for tests/spark/test_spark_autoregister.py.

``python spark_discovery_app.py URL STREAM``, run with the working directory outside the
project: writes 10 rows as the run ``main-thread`` before anything of this project is
imported (so only Spark's own lookup can find the format), then imports
``airflow_nats_ordered.spark`` (without calling ``register``) and writes the same DataFrame
from a new thread as the run ``new-thread``. Prints one JSON line per write:
``{"case": ..., "ok": bool, "error": str}`` (the error's first two lines: Spark's message).
"""

from __future__ import annotations

import json
import sys
import threading

from pyspark.sql import SparkSession
from pyspark.sql import functions as F


def main(url: str, stream: str) -> None:
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("nats-ordered-discovery-test")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.range(10).select(
        F.concat(F.lit("k"), F.col("id").cast("string")).alias("k"), F.col("id").alias("i")
    )

    def write(case: str) -> None:
        try:
            (
                df.write.format("nats-ordered")
                .option("stream", stream)
                .option("keyColumn", "k")
                .option("producerId", case)
                .option("url", url)
                .mode("append")
                .save()
            )
            result = {"case": case, "ok": True, "error": ""}
        except Exception as exc:  # reported to the test, with Spark's message
            message = " ".join(str(exc).splitlines()[:2])  # Spark's message, not its stack
            result = {"case": case, "ok": False, "error": f"{type(exc).__name__}: {message}"}
        print(json.dumps(result), flush=True)

    assert not any(m.startswith("airflow_nats_ordered") for m in sys.modules)
    write("main-thread")

    import airflow_nats_ordered.spark  # noqa: F401  (no register(): the import only)

    t = threading.Thread(target=write, args=("new-thread",))
    t.start()
    t.join(300)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
