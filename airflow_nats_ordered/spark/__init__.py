"""PySpark: the ``nats-ordered`` sink (batch and streaming) and its routing helpers.

``df.write.format("nats-ordered")`` is found by Spark in any session, directory and thread
(:mod:`.discovery`; ``register(spark)`` where Spark's lookup cannot see the package);
``write_ordered(df, stream=..., key=..., order_by=..., producer_id=...)`` routes, sorts and
publishes in one call and returns the run's ledger record. Importing this package needs
``pyspark`` and ``pyarrow`` (the ``spark`` extra); the core does not.
"""

from airflow_nats_ordered.spark.datasource import NAME, NatsOrderedDataSource
from airflow_nats_ordered.spark.discovery import register, use_in_this_thread
from airflow_nats_ordered.spark.options import PARTITION_COLUMN, SinkOptions
from airflow_nats_ordered.spark.ordered_write import ordered_batches, write_ordered
from airflow_nats_ordered.spark.records import DisorderError
from airflow_nats_ordered.spark.routing import partition_column, partitions_of, route
from airflow_nats_ordered.spark.runs import RunRefusedError, batch_run_id

__all__ = [
    "NAME",
    "PARTITION_COLUMN",
    "DisorderError",
    "NatsOrderedDataSource",
    "RunRefusedError",
    "SinkOptions",
    "batch_run_id",
    "ordered_batches",
    "partition_column",
    "partitions_of",
    "register",
    "route",
    "use_in_this_thread",
    "write_ordered",
]
