"""Spark 4's automatic registration of the ``nats-ordered`` data source.

Spark looks up Python data sources once per application: every top-level module whose name
starts with ``pyspark_`` that defines ``DefaultSource`` (a ``DataSource`` subclass) is
registered under ``DefaultSource.name()``. With this package installed (editable or from a
wheel), ``df.write.format("nats-ordered")`` works in any session and working directory
without ``airflow_nats_ordered.spark.register(spark)``; from any thread too once
``airflow_nats_ordered.spark`` is imported (see :mod:`airflow_nats_ordered.spark.discovery`).
"""

from airflow_nats_ordered.spark.datasource import NatsOrderedDataSource as DefaultSource

__all__ = ["DefaultSource"]
