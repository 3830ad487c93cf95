"""From the Arrow batches a Spark task receives to the records the core publisher sends.

* payload: the ``value`` column (string or binary) when there is one, else the row as compact
  JSON (every column but ``nats_partition`` and ``headers``; timestamps and dates in ISO 8601,
  decimals as strings, binary as base64), the same bytes on every attempt;
* key: the key column's text; a null or empty key is left to the publisher, which refuses it
  (counted, reported, never dropped silently);
* the declared order (``orderBy``) is checked per NATS partition, one whole batch before any
  of its rows is handed to the publisher: a task that receives rows of a partition out of
  order fails with :class:`DisorderError` having sent only rows that were in order.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import NatsOrderedError
from .options import HEADERS_COLUMN, PARTITION_COLUMN, VALUE_COLUMN, SinkOptions
from .routing import partitions_of

if TYPE_CHECKING:
    import pyarrow as pa


class DisorderError(NatsOrderedError):
    """Rows of one NATS partition reached a task out of the declared order."""


@dataclass(frozen=True, slots=True)
class SparkRecord:
    """One row as the core's ``publish_records`` reads it (a ``SourceRecord``)."""

    key: str | bytes | None
    payload: bytes
    msg_id: str | None
    where: str
    headers: dict[str, str] | None = None


def _json_default(v: Any) -> Any:
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes | bytearray):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    raise TypeError(f"cannot encode {type(v).__name__} as JSON")


def _sortable(v: Any) -> tuple[bool, Any]:
    # Spark sorts nulls first in ascending order
    return (v is not None, v)


class OrderCheck:
    """Remembers the last order value per NATS partition seen by this task."""

    def __init__(self, options: SinkOptions, partitions: int, task: str) -> None:
        self.columns = options.order_by
        self.key = options.key_column
        self.partitions = partitions
        self.task = task
        self.last: dict[int, tuple[Any, ...]] = {}

    def check(self, batch: pa.RecordBatch, parts: list[int | None], first_row: int) -> None:
        if not self.columns:
            return
        values = list(zip(*(batch.column(c).to_pylist() for c in self.columns), strict=True))
        for i, (p, v) in enumerate(zip(parts, values, strict=True)):
            if p is None:
                continue
            here = tuple(_sortable(x) for x in v)
            before = self.last.get(p)
            if before is not None and here < before:
                shown = ", ".join(f"{c}={x!r}" for c, x in zip(self.columns, v, strict=True))
                was = ", ".join(f"{c}={x[1]!r}" for c, x in zip(self.columns, before, strict=True))
                raise DisorderError(
                    f"{self.task}, row {first_row + i}: NATS partition {p} received "
                    f"{shown} after {was}, against orderBy {','.join(self.columns)}; nothing "
                    "out of order was sent. Route and sort the rows with "
                    "airflow_nats_ordered.spark.write_ordered(df, stream=..., key=..., "
                    "order_by=..., producer_id=...) (or route()) before writing"
                )
            self.last[p] = here


class BatchRecords:
    """Turns one task's Arrow batches into :class:`SparkRecord` lists, checking order."""

    def __init__(self, options: SinkOptions, schema_names: list[str], partitions: int, task: str):
        self.options = options
        self.partitions = partitions
        self.task = task
        self.check = OrderCheck(options, partitions, task)
        self.routed = PARTITION_COLUMN in schema_names
        self.has_value = VALUE_COLUMN in schema_names
        self.has_headers = HEADERS_COLUMN in schema_names
        self.json_columns = [c for c in schema_names if c not in (PARTITION_COLUMN, HEADERS_COLUMN)]
        self.rows = 0

    def records(self, batch: pa.RecordBatch) -> list[SparkRecord]:
        """The batch's records, after checking its order (raises :class:`DisorderError`)."""
        opts = self.options
        keys = batch.column(opts.key_column)
        if self.routed:
            parts = batch.column(PARTITION_COLUMN).to_pylist()
        else:
            parts = partitions_of(keys, self.partitions).to_pylist()
        first = self.rows
        self.check.check(batch, parts, first)
        if self.has_value:
            payloads = [
                b"" if v is None else (v.encode() if isinstance(v, str) else bytes(v))
                for v in batch.column(VALUE_COLUMN).to_pylist()
            ]
        else:
            dumps = json.JSONEncoder(
                separators=(",", ":"), ensure_ascii=False, default=_json_default
            ).encode
            payloads = [dumps(r).encode() for r in batch.select(self.json_columns).to_pylist()]
        ids: list[Any] = (
            batch.column(opts.msg_id_column).to_pylist()
            if opts.msg_id_column
            else [None] * batch.num_rows
        )
        headers: list[Any] = (
            [None if h is None else dict(h) for h in batch.column(HEADERS_COLUMN).to_pylist()]
            if self.has_headers
            else [None] * batch.num_rows
        )
        self.rows += batch.num_rows
        return [
            SparkRecord(
                k,
                data,
                None if mid is None else str(mid),
                f"{self.task}, row {first + i}",
                hdr,
            )
            for i, (k, data, mid, hdr) in enumerate(
                zip(keys.to_pylist(), payloads, ids, headers, strict=True)
            )
        ]
