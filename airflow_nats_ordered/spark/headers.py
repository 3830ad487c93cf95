"""The ``headers`` column: message headers, as Spark's Kafka sink takes them.

Two column types are accepted, checked on the driver when the writer is created (before the
run is begun or anything is sent):

* ``map<string, string|binary>``: one header per map entry;
* ``array<struct<key: string, value: string|binary>>``: Kafka's headers column, as Spark's
  Kafka source reads it (``includeHeaders``) and its sink writes it.

Any other type (``map<string,int>``, an array of other structs, ...) is refused with a
:class:`~airflow_nats_ordered.core.errors.ConfigError` naming the column, its type and the
cast to use. NATS headers are text, so per row:

* a binary value is its UTF-8 text; a value that is not UTF-8, a null value, a null name or
  a name given twice (Kafka allows repeated headers, the NATS publisher takes one value per
  name) refuses the row (:class:`BadHeaders`): counted and reported in the run record like
  a row without a key, the job failing unless ``allowRefused`` is true;
* names the publisher sets itself (``Nats-Msg-Id``, ``Nats-Ordered-*``), names that are not
  header tokens and values with line breaks are refused by the publisher the same way;
* a null ``headers`` cell or an empty map/array is a row without extra headers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.spark.options import HEADERS_COLUMN

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import DataType


class BadHeaders(dict[str, str]):
    """A row's headers that cannot be sent: the publisher refuses the row with ``reason``
    (:class:`~.resume.ResumingPublisher`), which the run record counts and reports."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


_FIX = (
    "cast it to map<string,string>, e.g. "
    f"df.withColumn({HEADERS_COLUMN!r}, F.col({HEADERS_COLUMN!r}).cast('map<string,string>')), "
    "or to Kafka's array<struct<key:string,value:binary>>; or rename the column to send it "
    "in the JSON payload"
)


def check_headers_type(typ: DataType) -> None:
    """Refuse a ``headers`` column type the sink cannot send (see the module docstring)."""
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StringType, StructType

    text = StringType | BinaryType
    if isinstance(typ, MapType):
        if isinstance(typ.keyType, StringType) and isinstance(typ.valueType, text):
            return
        why = (
            f"its header values are {typ.valueType.simpleString()}"
            if isinstance(typ.keyType, StringType)
            else f"its header names are {typ.keyType.simpleString()}"
        )
    elif isinstance(typ, ArrayType) and isinstance(typ.elementType, StructType):
        fields = {f.name: f.dataType for f in typ.elementType.fields}
        if (
            set(fields) == {"key", "value"}
            and isinstance(fields["key"], StringType)
            and isinstance(fields["value"], text)
        ):
            return
        why = (
            f"its structs are {typ.elementType.simpleString()}, not Kafka's "
            "struct<key:string,value:binary> (value may also be string)"
        )
    else:
        why = "it is neither a map nor Kafka's array of key/value structs"
    raise ConfigError(
        f"column {HEADERS_COLUMN!r} holds message headers, which are text: it must be "
        f"map<string,string>, map<string,binary> or array<struct<key:string,value:binary>> "
        f"(Kafka's headers), but it is {typ.simpleString()} ({why}). Nothing was sent; "
        f"{_FIX}"
    )


def _text(name: str, value: Any) -> str | BadHeaders:
    if value is None:
        return BadHeaders(
            f"header {name!r} is null in column {HEADERS_COLUMN!r} (NATS headers have no "
            "null value); drop null entries, e.g. F.map_filter('headers', lambda k, v: "
            "v.isNotNull()), or give them a value"
        )
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        return BadHeaders(
            f"header {name!r} in column {HEADERS_COLUMN!r} is binary that is not UTF-8 text "
            "(NATS headers are text); encode it, e.g. as base64"
        )


def _one(entries: list[tuple[Any, Any]]) -> dict[str, str] | None:
    out: dict[str, str] = {}
    for name, value in entries:
        if name is None:
            return BadHeaders(f"a header name is null in column {HEADERS_COLUMN!r}")
        if name in out:
            return BadHeaders(
                f"header {name!r} is given twice in column {HEADERS_COLUMN!r}; NATS messages "
                "from this sink carry one value per header name: join the values or rename one"
            )
        text = _text(name, value)
        if isinstance(text, BadHeaders):
            return text
        out[name] = text
    return out or None


def headers_of(column: pa.Array) -> list[dict[str, str] | None]:
    """Each row's headers from a ``headers`` Arrow column (a map, or a list of key/value
    structs): ``None`` for none, a :class:`BadHeaders` for a row that must be refused."""
    import pyarrow as pa

    rows = column.to_pylist()
    if pa.types.is_map(column.type):  # to_pylist: a list of (key, value) tuples per row
        return [None if r is None else _one(r) for r in rows]
    return [
        None
        if r is None
        else _one([(None, None) if e is None else (e["key"], e["value"]) for e in r])
        for r in rows
    ]
