"""What one input row becomes (:class:`InputRecord`): its payload JSON and its key and msg-id text.

Guarantees: the payload is the row as compact UTF-8 JSON with every value made JSON-safe
(:func:`json_safe`: timestamps and dates ISO 8601, decimals exact strings, binary base64,
NaN/inf null), the same for every reader; the key and msg-id are the canonical key text of
the row's values as read (:func:`~..core.stream.keys.key_text`), or an :class:`InputError` naming
the row, the field (as a CLI flag or a Python parameter) and the value.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from airflow_nats_ordered.core.errors import ConfigError, KeyTextError
from airflow_nats_ordered.core.stream.keys import key_field_text, key_text


class InputError(ConfigError):
    """The input file cannot be read as asked (format, missing field, malformed row)."""


class InputRecord(NamedTuple):
    """One input row, ready for ``OrderedPublisher.publish(key, payload, msg_id=...)``."""

    key: str | None
    payload: bytes
    msg_id: str | None
    where: str


def json_safe(value: Any) -> Any:
    """``value`` converted to types ``json.dumps`` writes as standard JSON.

    Timestamps, dates and times become ISO 8601 strings (with the offset when the value
    has a time zone); durations seconds (float); decimals strings (exact); bytes base64
    strings; NaN and infinities ``null``; maps objects (or lists of ``[key, value]`` pairs
    when a key is not a string); lists, tuples and structs recursively.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value) if value.is_finite() else None
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        # pyarrow returns a map column as a list of (key, value) tuples
        if value and all(isinstance(x, tuple) and len(x) == 2 for x in value):
            if all(isinstance(k, str) for k, _ in value):
                return {k: json_safe(v) for k, v in value}
            return [[json_safe(k), json_safe(v)] for k, v in value]
        return [json_safe(x) for x in value]
    if hasattr(value, "isoformat"):  # e.g. pandas.Timestamp for nanosecond timestamps
        return value.isoformat()
    return str(value)


def dumps_payload(row: Any) -> bytes:
    """A record's payload: ``row`` (already JSON-safe) as compact UTF-8 JSON."""
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


#: how errors name the fields: as ``nats-ordered publish`` flags, or as Python parameters
CLI_NAMES = {
    "key_field": "--key-field",
    "msg_id_field": "--msg-id-field",
    "order_by": "--order-by",
}
PYTHON_NAMES = {"key_field": "key_field", "msg_id_field": "msg_id_field", "order_by": "order_by"}


def key_and_msg_id(
    row: Mapping[str, Any],
    key_field: str | None,
    id_field: str | None,
    where: str,
    names: Mapping[str, str],
) -> tuple[str | None, str | None]:
    """The key and msg-id text of one row (from its values as read, before they are made
    JSON-safe), or :class:`InputError` naming the row, the field and the value."""
    try:
        key = key_field_text(row.get(key_field)) if key_field is not None else None
    except KeyTextError as exc:
        raise InputError(
            exc.message_for(f"{where}: {names['key_field']} {key_field!r} value")
        ) from None
    try:
        msg_id = key_text(row.get(id_field)) if id_field is not None else None
    except KeyTextError as exc:
        raise InputError(
            exc.message_for(f"{where}: {names['msg_id_field']} {id_field!r} value")
        ) from None
    return key, msg_id
