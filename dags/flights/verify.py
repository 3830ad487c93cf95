"""Check the sink against Spark: every aircraft's running totals up to a day, as the worker
pool applied them, equal the window-function reference (``spark_apps/reference_totals.py``)
over the same flights in the same order."""

from __future__ import annotations

import datetime as dt
import importlib.util
import sqlite3
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from flights.handlers import create_tables
from flights.settings import FIRST_DAY

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class Verification:
    """The comparison of one day: ``verified`` only if nothing is missing, extra or wrong.

    ``flights``: reference flights up to the day; ``aircraft``: aircraft among them;
    ``missing``/``extra``: flights only in the reference / only in the sink; ``wrong``:
    flights whose running values (or aircraft whose totals) differ."""

    day: str
    aircraft: int
    flights: int
    missing: int
    extra: int
    wrong: int

    @property
    def verified(self) -> bool:
        return not (self.missing or self.extra or self.wrong)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verified": self.verified}


def spark_app(spark_apps: str | Path, name: str) -> ModuleType:
    """Import ``<spark_apps>/<name>.py`` (the folder is a set of scripts, not a package)."""
    folder = str(Path(spark_apps).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, Path(folder) / f"{name}.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no {name}.py in {folder}: set FLIGHTS_SPARK_APPS")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(spark: SparkSession, spark_apps: str | Path, day: dt.date) -> pd.DataFrame:
    """Per flight from the first day of the data to ``day``: ``tailnum, n, flight_id,
    run_distance, run_air_time`` computed by Spark window functions."""
    ref = spark_app(spark_apps, "reference_totals")
    flights = ref.load_flights(spark, FIRST_DAY, day)
    return ref.running_totals(flights).toPandas()


def sink_state(path: str | Path, day: dt.date) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The sink's per-flight running values of flights scheduled up to ``day``, and the
    aircraft totals of the aircraft whose last applied flight is on or before ``day``."""
    import pandas as pd

    create_tables(path)
    end = (day + dt.timedelta(days=1)).isoformat()
    with sqlite3.connect(path, timeout=30) as conn:
        rows = pd.read_sql_query(
            "SELECT tailnum, n, flight_id, distance AS run_distance, air_time AS run_air_time "
            "FROM flight_running WHERE sched_dep < ?",
            conn,
            params=(end,),
        )
        totals = pd.read_sql_query(
            "SELECT a.tailnum, a.flights, a.distance, a.air_time FROM aircraft a WHERE NOT "
            "EXISTS (SELECT 1 FROM flight_running f WHERE f.tailnum = a.tailnum AND "
            "f.sched_dep >= ?)",
            conn,
            params=(end,),
        )
    return rows, totals


def compare(
    day: dt.date, ref: pd.DataFrame, rows: pd.DataFrame, totals: pd.DataFrame
) -> Verification:
    """Match the sink against the reference flight by flight (aircraft, n-th flight) and
    aircraft by aircraft."""
    merged = ref.merge(
        rows, on=["tailnum", "n"], how="outer", suffixes=("", "_got"), indicator=True
    )
    both = merged[merged["_merge"] == "both"]
    wrong = (
        (both["flight_id"] != both["flight_id_got"])
        | (both["run_distance"] != both["run_distance_got"])
        | (both["run_air_time"] != both["run_air_time_got"])
    )
    last = ref.sort_values("n").groupby("tailnum").tail(1)
    t = totals.merge(last, on="tailnum", how="left")
    totals_wrong = (
        (t["flights"] != t["n"])
        | (t["distance"] != t["run_distance"])
        | (t["air_time"] != t["run_air_time"])
    )
    return Verification(
        day=day.isoformat(),
        aircraft=int(ref["tailnum"].nunique()),
        flights=len(ref),
        missing=int((merged["_merge"] == "left_only").sum()),
        extra=int((merged["_merge"] == "right_only").sum()),
        wrong=int(wrong.sum()) + int(totals_wrong.sum()),
    )


def verify_day(day: dt.date, sink_db: str | Path, spark_apps: str | Path) -> Verification:
    """Compare the sink with the Spark reference up to ``day``. Uses the process's active
    SparkSession if there is one (local otherwise, stopped afterwards)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    own = SparkContext._active_spark_context is None  # a session of this process is reused
    spark = (
        SparkSession.builder.master("local[2]")
        .appName(f"verify flights {day}")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    try:
        ref = reference(spark, spark_apps, day)
    finally:
        if own:
            spark.stop()
    rows, totals = sink_state(sink_db, day)
    return compare(day, ref, rows, totals)
