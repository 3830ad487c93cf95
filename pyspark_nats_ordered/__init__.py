"""Spark 4's automatic registration of the ``nats-ordered`` data source.

Spark looks up Python data sources once per application: every top-level module whose name
starts with ``pyspark_`` that defines ``DefaultSource`` (a ``DataSource`` subclass) is
registered under ``DefaultSource.name()``. With this package installed,
``df.write.format("nats-ordered")`` works in any session and any thread, without
``airflow_nats_ordered.spark.register(spark)``.
"""

from airflow_nats_ordered.spark.datasource import NatsOrderedDataSource as DefaultSource

__all__ = ["DefaultSource"]
