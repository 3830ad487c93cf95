"""Routing rows to NATS partitions inside Spark, with the one partition function.

Spark's built-in ``hash()`` is not murmur3_x86_32 with seed 0 over UTF-8 bytes for keys whose
length is not a multiple of 4, so the ``nats_partition`` column is computed with
:func:`~airflow_nats_ordered.core.stream.partitioning.partition_for` itself, one Arrow batch at a
time (an Arrow UDF: one JVM/Python exchange per batch, not per row).

:func:`route` then makes every NATS partition the rows of exactly one Spark task, sorted by
(partition, order columns, a deterministic tie-breaker): one task publishes a whole
partition, in order, and a row's position in its partition does not depend on Spark's
physical partitioning or on the attempt.

Key columns follow the canonical key-text rule
(:func:`~airflow_nats_ordered.core.stream.keys.key_text`): string
columns are their text, integral columns (byte/short/int/long) their exact decimal digits
(so an integral key routes exactly like its decimal text), binary columns their UTF-8 text;
float/double/decimal/boolean/date/timestamp and nested key columns are refused before any
job runs, naming the cast to use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mmh3

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.spark.options import HEADERS_COLUMN, PARTITION_COLUMN

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructType


#: the column :func:`~.ordered_write.write_ordered` adds with the text of an integral key
#: column (the sink publishes that text as the key; the column is not in the payload)
KEY_TEXT_COLUMN = "nats_key"
#: the column a carried-over run's rows get (:func:`~.repartitioned.pass_over_old_layout`):
#: each keyed row's rank among the run's rows of its key in the whole input, counted before
#: the rows the old layout stored are taken out, so the row's derived msg-id is the one it
#: had on the old layout (the sink uses it, it is not in the payload)
KEY_RANK_COLUMN = "__nats_key_rank"
#: columns the default tie-breaker's row hash leaves out (not the row's own values)
NOT_IN_TIES = (PARTITION_COLUMN, HEADERS_COLUMN, KEY_RANK_COLUMN)


def key_values(keys: pa.Array) -> list[str | bytes | None]:
    """The keys of an Arrow key column as the publisher takes them: strings and binary as
    they are, integers as their exact decimal text (the canonical key-text rule)."""
    import pyarrow as pa

    values = keys.to_pylist()
    if pa.types.is_integer(keys.type):
        return [None if v is None else str(v) for v in values]
    return values


def partitions_of(keys: pa.Array, partitions: int) -> pa.Array:
    """``partition_for`` over an Arrow array of string, binary or integer keys (null stays
    null; an integer is hashed as its decimal text). Each distinct key is hashed once (keys
    repeat: a batch holds many rows per key), the rest is Arrow's ``take``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if pa.types.is_null(keys.type):  # every key null
        return pa.nulls(len(keys), pa.int32())
    if pa.types.is_integer(keys.type):
        keys = pc.cast(keys, pa.string())  # exact decimal digits, as str(int)
    encoded = pc.dictionary_encode(keys)
    distinct = pa.array(
        [
            None if k is None else partition_for(k, partitions)
            for k in encoded.dictionary.to_pylist()
        ],
        pa.int32(),
    )
    return pc.take(distinct, encoded.indices)


def partition_column(key: str | Column, partitions: int) -> Column:
    """A Column with each row's NATS partition among ``partitions``, exactly as the core
    computes it. ``key`` must be a string or binary column."""
    from pyspark.sql import functions as F

    if partitions < 1:
        raise ConfigError(f"partitions must be >= 1, got {partitions}")

    def nats_partition(keys: pa.Array) -> pa.Array:
        return partitions_of(keys, partitions)

    udf = F.arrow_udf(nats_partition, "int", F.ArrowUDFType.SCALAR)
    return udf(F.col(key) if isinstance(key, str) else key)


def is_integral_key(df: DataFrame, key: str) -> bool:
    """True if ``key`` is an integral column (its key text is its decimal digits)."""
    from pyspark.sql.types import ByteType, IntegerType, LongType, ShortType

    return isinstance(df.schema[key].dataType, ByteType | ShortType | IntegerType | LongType)


def check_key_column(df: DataFrame, key: str, what: str = "key column") -> None:
    """A key column must be string, binary (UTF-8) or integral (byte/short/int/long): the
    types with one key text in every language. Any other type is refused, naming the cast
    that gives Spark's own spelling if that is really wanted."""
    check_key_type(df.schema, key, what)


def check_key_type(schema: StructType, key: str, what: str = "key column") -> None:
    """:func:`check_key_column` for a schema (the data source sees no DataFrame)."""
    from pyspark.sql.types import (
        BinaryType,
        ByteType,
        IntegerType,
        LongType,
        ShortType,
        StringType,
    )

    fields = {f.name: f for f in schema.fields}
    if key not in fields:
        raise ConfigError(f"{what} {key!r} is not in the DataFrame (columns: {', '.join(fields)})")
    typ = fields[key].dataType
    if not isinstance(typ, StringType | BinaryType | ByteType | ShortType | IntegerType | LongType):
        raise ConfigError(
            f"{what} {key!r} is {typ.simpleString()}; key text must be the same in every "
            "language, so only string, integral (byte/short/int/long) and UTF-8 binary "
            "columns are keys. Make it one of those; if Spark's own text of the value is "
            f"what you want, cast it first: df.withColumn({key!r}, "
            f"F.col({key!r}).cast('string'))"
        )


def route(
    df: DataFrame,
    *,
    key: str,
    partitions: int,
    order_by: Sequence[str] = (),
    tie_breaker: Sequence[str] | None = None,
    tasks: int | None = None,
) -> DataFrame:
    """``df`` with a ``nats_partition`` column, repartitioned so each NATS partition is in
    exactly one of ``tasks`` Spark partitions (default: the NATS partition count, at most
    Spark's default parallelism: a task per core, each publishing whole partitions; NATS
    partition ``p`` is in task ``p % tasks``, so the tasks hold equal numbers of them),
    sorted within them by (``nats_partition``, ``order_by``, tie-breaker).

    The tie-breaker makes the order of rows with equal order values deterministic, so a
    recomputed partition (task retry, re-submitted job) lists its rows in the same order and
    the derived msg-ids are the same: ``tie_breaker`` columns if given (they should identify a
    row), else the key and a 64-bit hash of the whole row (rows that tie on all of these are
    identical, so their order does not change any msg-id).
    """
    from pyspark.sql import functions as F

    check_key_column(df, key)
    missing = [c for c in (*order_by, *(tie_breaker or ())) if c not in df.columns]
    if missing:
        raise ConfigError(
            f"order/tie-breaker column(s) {', '.join(missing)} are not in the DataFrame "
            f"(columns: {', '.join(df.columns)})"
        )
    row = [F.col(c) for c in df.columns if c not in NOT_IN_TIES]
    ties = [F.col(c) for c in tie_breaker] if tie_breaker else [F.col(key), F.xxhash64(*row)]
    routed = df.withColumn(PARTITION_COLUMN, partition_column(key, partitions))
    if tasks is None:
        tasks = min(partitions, df.sparkSession.sparkContext.defaultParallelism)
    if tasks < 1:
        raise ConfigError(f"tasks must be >= 1, got {tasks}")
    return routed.repartition(tasks, task_column(PARTITION_COLUMN, tasks)).sortWithinPartitions(
        F.col(PARTITION_COLUMN), *[F.col(c) for c in order_by], *ties
    )


def task_buckets(tasks: int) -> list[int]:
    """For each Spark task ``t`` of ``tasks``, the smallest int whose Spark hash partitioning
    (``pmod(murmur3_x86_32(int, seed 42), tasks)``, what ``repartition(tasks, col)`` computes
    for an int column) is ``t``."""
    buckets: dict[int, int] = {}
    v = 0
    while len(buckets) < tasks:
        t = mmh3.hash(v.to_bytes(4, "little", signed=True), 42) % tasks
        buckets.setdefault(t, v)
        v += 1
    return [buckets[t] for t in range(tasks)]


def task_column(partition: str, tasks: int) -> Column:
    """A column to ``repartition(tasks, ...)`` by that puts NATS partition ``p`` in Spark
    task ``p % tasks``: each task gets ``partitions // tasks`` or one more whole NATS
    partitions. Repartitioning by the partition number itself hashes it, which splits 16
    NATS partitions 7/9 over 2 tasks and 4 partitions 1/3, so one task publishes most of the
    rows while the other core idles. Every row of a NATS partition gets the same value
    whatever the hash, so a partition is always in one task; the hash only spreads them."""
    from pyspark.sql import functions as F

    buckets = F.array(*[F.lit(b) for b in task_buckets(tasks)])
    return F.element_at(buckets, (F.col(partition) % F.lit(tasks) + F.lit(1)).cast("int"))
