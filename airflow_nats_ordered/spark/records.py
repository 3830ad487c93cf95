"""From the Arrow batches a Spark task receives to the records the core publisher sends.

* payload: the ``value`` column (string or binary) when there is one, else the row as compact
  JSON (every column but ``nats_partition`` and ``headers``; timestamps and dates in ISO 8601,
  decimals as strings, binary as base64), the same bytes on every attempt;
* key: the key column's canonical text (strings and binary as they are, integers as exact
  decimal digits: :func:`~.routing.key_values`); a null or empty key is left to the
  publisher, which refuses it (counted, reported, never dropped silently), as it refuses a
  key that is not UTF-8 or longer than 4096 bytes;
* the declared order (``orderBy``) is checked per NATS partition, one whole batch before any
  of its rows is handed to the publisher: a task that receives rows of a partition out of
  order fails with :class:`DisorderError` having sent only rows that were in order;
* unrouted rows of a micro-batch get msg-ids from their content (:class:`ContentIds`), not
  from their task and position, so a replay with another task layout stores nothing twice;
* a ``nats_partition`` column (routed rows: positions are ranks in whole NATS partitions)
  is checked the same way, before any row of the batch is sent: every keyed row's value must
  be the partition the stream routes its key to, and a task's rows must come partition by
  partition, as :func:`~.routing.route` sorts them; else :class:`RoutingError`.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import hashlib
import json
from collections import Counter
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.spark.headers import headers_of
from airflow_nats_ordered.spark.options import (
    HEADERS_COLUMN,
    PARTITION_COLUMN,
    VALUE_COLUMN,
    SinkOptions,
)
from airflow_nats_ordered.spark.routing import (
    KEY_RANK_COLUMN,
    KEY_TEXT_COLUMN,
    key_values,
    partitions_of,
)

if TYPE_CHECKING:
    import pyarrow as pa


class DisorderError(NatsOrderedError):
    """Rows of one NATS partition reached a task out of the declared order."""


class RoutingError(ConfigError):
    """A ``nats_partition`` column that is not the stream's routing of the rows' keys, or
    whose rows do not reach the task partition by partition (found before sending)."""


_ROUTE_FIX = (
    "Publish with airflow_nats_ordered.spark.write_ordered(df, stream=..., key=..., "
    "producer_id=...), or route(df, key=..., partitions=...) before writing, which compute "
    f"the column and put each NATS partition's rows in one task in order; or drop the "
    f"{PARTITION_COLUMN!r} column to publish the rows unrouted. Nothing of this batch was sent"
)


class RoutingCheck:
    """Checks a task's ``nats_partition`` values against the stream's routing of its keys."""

    def __init__(self, partitions: int, key_column: str, task: str) -> None:
        self.partitions = partitions
        self.key_column = key_column
        self.task = task
        self.last: int | None = None

    def check(self, keys: pa.Array, parts: pa.Array, first_row: int) -> None:
        """Raise :class:`RoutingError` at the first keyed row whose partition is not its
        key's, or that comes after a row of a higher partition. Checked over whole columns;
        only a batch with a problem is walked row by row, to name the row."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if len(keys) == 0 or pa.types.is_null(keys.type):  # no keyed row
            return
        expected = partitions_of(keys, self.partitions)
        text = pc.cast(keys, pa.string()) if pa.types.is_integer(keys.type) else keys
        keyed = pc.fill_null(pc.greater(pc.binary_length(text), 0), False)
        got = parts.filter(keyed)
        ok = pc.all(pc.fill_null(pc.equal(got, expected.filter(keyed)), False)).as_py()
        if ok is not False and len(got):
            g = got.to_numpy(zero_copy_only=False)
            start = g[0] if self.last is None else self.last
            ok = bool(g[0] >= start and (g[1:] >= g[:-1]).all())
            if ok:
                self.last = int(g[-1])
        if ok is not False:
            return
        self._walk(keys, parts, expected.to_pylist(), first_row)

    def _walk(self, keys: pa.Array, parts: pa.Array, expected: list[Any], first_row: int) -> None:
        last = self.last
        for i, (k, got, want) in enumerate(
            zip(key_values(keys), parts.to_pylist(), expected, strict=True)
        ):
            if not k:  # keyless: refused by the publisher, or round-robin if allowed
                continue
            if got != want:
                raise RoutingError(
                    f"{self.task}, row {first_row + i}: column {PARTITION_COLUMN!r} is {got!r} "
                    f"for key {k!r}, but the stream routes that key to partition {want} "
                    f"(murmur3 of the key text over its {self.partitions} partitions; Spark's "
                    "hash() is another function, and a column computed for another partition "
                    "count, e.g. the stream's count before a repartition, is another routing: "
                    f"compute it with partition_column({self.key_column!r}, "
                    f"{self.partitions})). {_ROUTE_FIX}"
                )
            if last is not None and got < last:
                raise RoutingError(
                    f"{self.task}, row {first_row + i}: a row of NATS partition {got} came after "
                    f"rows of partition {last}: routed rows must reach a task partition by "
                    "partition (each NATS partition in one task, in order), or positions "
                    f"and msg-ids would collide. {_ROUTE_FIX}"
                )
            last = got
        self.last = last


class ContentIds:
    """Msg-ids of a micro-batch's unrouted rows, from the rows alone.

    A row's id is a digest of the run (``<producerId>.<query id>.batch-<id>``), its key, its
    payload, its headers and its copy number: 1 for the first row of the task with that key,
    payload and headers, 2 for the next identical one, and so on. Nothing of the Spark task or
    the row's position is in it, so a micro-batch replayed with another task layout (another
    core count, another ``repartition``) gives each row the id it had, and the stream's
    de-duplication stores it once. Identical rows that Spark puts in different tasks of one
    micro-batch get the same id, and the stream keeps one of them (counted as duplicates in
    the run record): rows that must be stored as separate records need a column telling them
    apart (an event id, the source offset) or a ``msgIdColumn``."""

    def __init__(self, run: str) -> None:
        self.run = run.encode()
        self.copies: Counter[bytes] = Counter()

    def __call__(self, key: str | bytes | None, payload: bytes, headers: Any) -> str:
        kb = b"" if key is None else key.encode() if isinstance(key, str) else bytes(key)
        hb = b"" if not headers else json.dumps(sorted(headers.items())).encode()
        row = hashlib.blake2b(
            b"%d:%s\x00%d:%s\x00%s" % (len(kb), kb, len(hb), hb, payload), digest_size=16
        ).digest()
        self.copies[row] += 1
        return hashlib.blake2b(
            b"%s\x00%s\x00%d" % (self.run, row, self.copies[row]), digest_size=15
        ).hexdigest()


class SparkRecord:
    """One row as the core's ``publish_records`` reads it (a ``SourceRecord``)."""

    __slots__ = ("key", "payload", "msg_id", "headers", "_task", "_row")

    def __init__(
        self,
        key: str | bytes | None,
        payload: bytes,
        msg_id: str | None,
        headers: dict[str, str] | None,
        task: str,
        row: int,
    ) -> None:
        self.key, self.payload, self.msg_id, self.headers = key, payload, msg_id, headers
        self._task, self._row = task, row

    @property
    def where(self) -> str:
        return f"{self._task}, row {self._row}"


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


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_json_default).encode


def _column_json(column: pa.Array) -> list[str]:
    """Each value's JSON text, as ``json.dumps`` writes it inside the row object (the same
    text, computed a column at a time: strings and integers without a call per value)."""
    import pyarrow as pa

    t = column.type
    values = column.to_pylist()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ["null" if v is None else encode_basestring(v) for v in values]
    if pa.types.is_integer(t):
        return ["null" if v is None else str(v) for v in values]
    if pa.types.is_boolean(t):
        return ["null" if v is None else ("true" if v else "false") for v in values]
    return [_dumps(v) for v in values]


#: what ``json.dumps(..., ensure_ascii=False)`` escapes in a string (json.encoder.ESCAPE):
#: a string column without any of these is its value between quotes (RE2 syntax)
_NEEDS_ESCAPE = r'[\x00-\x1f"\\]'


def _column_json_arrow(column: pa.Array) -> pa.Array:
    """:func:`_column_json` as an Arrow string array, computed by Arrow kernels for the
    common types (strings without a character to escape, integers, booleans); the rest, and
    a string column with any character to escape, are encoded in Python value by value."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if (
        pa.types.is_string(t)
        and not pc.any(pc.match_substring_regex(column, _NEEDS_ESCAPE)).as_py()
    ):
        text = pc.binary_join_element_wise('"', column, '"', "")
    elif pa.types.is_integer(t):
        text = pc.cast(column, pa.string())  # exact decimal digits, as str(int)
    elif pa.types.is_boolean(t):
        text = pc.if_else(column, "true", "false")
    else:
        return pa.array(_column_json(column), pa.string())
    return pc.fill_null(text, "null") if column.null_count else text


def rows_as_json(batch: pa.RecordBatch, columns: list[str]) -> list[bytes]:
    """Each row of ``batch`` (``columns`` only, in that order) as compact JSON: exactly
    ``json.dumps(row, separators=(",", ":"), ensure_ascii=False)`` with ISO 8601 dates and
    times, decimals as strings and binary as base64. Built a column at a time by Arrow's
    string kernels (one concatenation of the columns' JSON texts between the names), so
    Python touches each row once, to take its bytes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not columns or batch.num_rows == 0:
        return [b"{}"] * batch.num_rows
    parts: list[Any] = []
    sep = "{"
    for c in columns:
        parts.append(f"{sep}{encode_basestring(c)}:")
        parts.append(_column_json_arrow(batch.column(c)))
        sep = ","
    parts.append("}")
    joined = pc.binary_join_element_wise(*parts, "")
    return pc.cast(joined, pa.binary()).to_pylist()


def _key(values: tuple[Any, ...]) -> tuple[tuple[bool, Any], ...]:
    # Spark sorts nulls first in ascending order
    return tuple((v is not None, v) for v in values)


class OrderCheck:
    """Remembers the last order value per NATS partition seen by this task."""

    def __init__(self, options: SinkOptions, partitions: int, task: str) -> None:
        self.columns = options.order_by
        self.key = options.key_column
        self.partitions = partitions
        self.task = task
        self.last: dict[int, tuple[Any, ...]] = {}

    def check(self, batch: pa.RecordBatch, parts: pa.Array, first_row: int) -> None:
        """Raise :class:`DisorderError` if, within some NATS partition, a row of ``batch``
        sorts before the row that arrived before it (in this batch or an earlier one). Rows
        are compared as Spark sorts ascending: by each order column in turn, nulls first."""
        if not self.columns or batch.num_rows == 0:
            return
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        n = batch.num_rows
        arrival = pa.array(np.arange(n))
        # each partition's rows together, in arrival order
        order = pc.sort_indices(
            pa.table({"p": parts, "i": arrival}),
            sort_keys=[("p", "ascending"), ("i", "ascending")],
        )
        grouped = pc.take(parts, order)
        cols = [pc.take(batch.column(c), order) for c in self.columns]
        if n > 1:
            later_smaller = None
            for c in reversed(cols):
                a, b = c[:-1], c[1:]
                a_null, b_null = pc.is_null(a), pc.is_null(b)
                lt = pc.or_(pc.and_(b_null, pc.invert(a_null)), pc.fill_null(pc.less(b, a), False))
                eq = pc.or_(pc.and_(a_null, b_null), pc.fill_null(pc.equal(b, a), False))
                later_smaller = (
                    lt if later_smaller is None else pc.or_(lt, pc.and_(eq, later_smaller))
                )
            same = pc.fill_null(pc.equal(grouped[:-1], grouped[1:]), False)
            bad = pc.and_(same, later_smaller)
            if pc.any(bad).as_py():
                j = pc.index(bad, True).as_py()
                self._refuse(
                    grouped[j].as_py(),
                    first_row + order[j + 1].as_py(),
                    tuple(c[j + 1].as_py() for c in cols),
                    tuple(c[j].as_py() for c in cols),
                )
        runs = pc.run_end_encode(grouped)
        start = 0
        for p, end in zip(runs.values.to_pylist(), runs.run_ends.to_pylist(), strict=True):
            if p is not None:
                first = tuple(c[start].as_py() for c in cols)
                before = self.last.get(p)
                if before is not None and _key(first) < _key(before):
                    self._refuse(p, first_row + order[start].as_py(), first, before)
                self.last[p] = tuple(c[end - 1].as_py() for c in cols)
            start = end

    def _refuse(self, p: int, row: int, value: tuple[Any, ...], before: tuple[Any, ...]) -> None:
        shown = ", ".join(f"{c}={x!r}" for c, x in zip(self.columns, value, strict=True))
        was = ", ".join(f"{c}={x!r}" for c, x in zip(self.columns, before, strict=True))
        raise DisorderError(
            f"{self.task}, row {row}: NATS partition {p} received {shown} after {was}, "
            f"against orderBy {','.join(self.columns)}; nothing of this batch was sent. "
            "Route and sort the rows with airflow_nats_ordered.spark.write_ordered(df, "
            "stream=..., key=..., order_by=..., producer_id=...) (or route()) before writing"
        )


class BatchRecords:
    """Turns one task's Arrow batches into :class:`SparkRecord` lists, checking order."""

    def __init__(
        self,
        options: SinkOptions,
        schema_names: list[str],
        partitions: int,
        task: str,
        *,
        content_ids: str | None = None,
    ):
        self.options = options
        #: unrouted rows of a micro-batch: ids from the rows (``content_ids`` is the run)
        self.content_ids = (
            ContentIds(content_ids) if content_ids and not options.msg_id_column else None
        )
        self.partitions = partitions
        self.task = task
        self.check = OrderCheck(options, partitions, task)
        self.routed = PARTITION_COLUMN in schema_names
        self.routing = RoutingCheck(partitions, options.key_column, task)
        self.has_value = VALUE_COLUMN in schema_names
        self.has_headers = HEADERS_COLUMN in schema_names
        self.has_ranks = KEY_RANK_COLUMN in schema_names
        hidden = {PARTITION_COLUMN, HEADERS_COLUMN, KEY_RANK_COLUMN}
        if options.key_column == KEY_TEXT_COLUMN:
            hidden.add(KEY_TEXT_COLUMN)  # write_ordered's text of an integral key column
        self.json_columns = [c for c in schema_names if c not in hidden]
        self.rows = 0

    def columns(self, batch: pa.RecordBatch) -> BatchColumns:
        """The batch's keys, payloads, msg-ids, headers and (routed rows) NATS partitions, as
        Python lists, after checking its order and routing (raises :class:`DisorderError`,
        :class:`RoutingError`); ``first``: the task's row number of its first row."""
        opts = self.options
        keys = batch.column(opts.key_column)
        first = self.rows
        routed: list[Any] | None = None
        if self.routed:
            parts = batch.column(PARTITION_COLUMN)
            self.routing.check(keys, parts, first)
            routed = parts.to_pylist()
        else:
            parts = partitions_of(keys, self.partitions)
        self.check.check(batch, parts, first)
        if self.has_value:
            payloads = [
                b"" if v is None else (v.encode() if isinstance(v, str) else bytes(v))
                for v in batch.column(VALUE_COLUMN).to_pylist()
            ]
        else:
            payloads = rows_as_json(batch, self.json_columns)
        n = batch.num_rows
        ids: list[Any] = (
            [None if v is None else str(v) for v in batch.column(opts.msg_id_column).to_pylist()]
            if opts.msg_id_column
            else [None] * n
        )
        headers: list[Any] = (
            headers_of(batch.column(HEADERS_COLUMN)) if self.has_headers else [None] * n
        )
        self.rows += n
        keys_list = key_values(keys)
        if self.content_ids is not None:
            ids = [
                self.content_ids(k, data, hdr)
                for k, data, hdr in zip(keys_list, payloads, headers, strict=True)
            ]
        ranks: list[Any] = (
            batch.column(KEY_RANK_COLUMN).to_pylist() if self.has_ranks else [None] * n
        )
        return BatchColumns(keys_list, payloads, ids, headers, routed or [None] * n, first, ranks)

    def records(self, batch: pa.RecordBatch) -> list[SparkRecord]:
        """The batch's records, after checking its order (raises :class:`DisorderError`)."""
        c = self.columns(batch)
        task = self.task
        return [
            SparkRecord(k, data, mid, hdr, task, c.first + i)
            for i, (k, data, mid, hdr) in enumerate(
                zip(c.keys, c.payloads, c.ids, c.headers, strict=True)
            )
        ]


class BatchColumns(NamedTuple):
    """One batch's rows as parallel lists (see :meth:`BatchRecords.columns`)."""

    keys: list[str | bytes | None]
    payloads: list[bytes]
    ids: list[str | None]
    headers: list[dict[str, str] | None]
    #: per row its ``nats_partition`` (routed rows), else None
    parts: list[int | None]
    first: int
    #: per row its rank among the run's rows of its key when the rows carry it (a run
    #: carried over a repartition: ``KEY_RANK_COLUMN``), else None
    ranks: list[int | None]
