"""The reference the worker pool must match: per-aircraft running totals, with window
functions over the same flights in the same order as ``publish_flights.py`` publishes them.

    spark-submit spark_apps/reference_totals.py --start 2013-01-01 [--end ...] --out ref.parquet

One row per flight with a tail number: ``tailnum, n, flight_id, run_distance,
run_air_time`` (the aircraft's n-th flight and its totals right after it; a missing air
time counts 0), as the ``flight_running`` table of the AircraftTotals handler holds them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from publish_flights import KEY, ORDER, TIE_BREAKER, _date, load_flights  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def running_totals(flights: DataFrame) -> DataFrame:
    """Per aircraft, in (scheduled departure, carrier, flight, origin) order: the flight's
    rank and the running sums of distance and air time."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = [*ORDER, *TIE_BREAKER]
    upto = (
        Window.partitionBy(KEY)
        .orderBy(*order)
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    return flights.where(F.col(KEY).isNotNull() & (F.col(KEY) != "")).select(
        KEY,
        F.row_number().over(Window.partitionBy(KEY).orderBy(*order)).alias("n"),
        "flight_id",
        F.sum(F.coalesce(F.col("distance").cast("long"), F.lit(0)))
        .over(upto)
        .alias("run_distance"),
        F.sum(F.coalesce(F.col("air_time").cast("long"), F.lit(0)))
        .over(upto)
        .alias("run_air_time"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=_date, required=True)
    parser.add_argument("--end", type=_date)
    parser.add_argument("--out", required=True, help="Parquet output path (overwritten)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    spark = SparkSession.builder.appName("reference_totals").getOrCreate()
    try:
        ref = running_totals(load_flights(spark, args.start, args.end or args.start))
        ref.write.mode("overwrite").parquet(args.out)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
