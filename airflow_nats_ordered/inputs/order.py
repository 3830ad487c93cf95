"""The ``order_by`` rule of the publish inputs: a stable total order over column values.

Guarantees: rows are sorted stably (rows with equal sort values keep their input order);
within one column nulls (and empty CSV values, NaN) sort last, numbers before strings, and
a CSV column whose every non-empty value is a number sorts numerically. Sorting loads the
whole input in memory.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Sequence
from typing import Any

from airflow_nats_ordered.inputs.records import InputError, dumps_payload, json_safe


def sort_value(value: Any) -> tuple[Any, ...]:
    """A total order over one column's values: nulls last, numbers, strings, then the rest."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return (1,)
    if isinstance(value, bool | int | float | decimal.Decimal):
        return (0, 0, value)
    if isinstance(value, str):
        return (0, 1, value)
    if isinstance(value, dt.datetime):
        # naive and aware timestamps never share a typed column; compare their text otherwise
        return (0, 2, value.isoformat()) if value.tzinfo is None else (0, 3, value)
    if isinstance(value, dt.date | dt.time | dt.timedelta | bytes):
        return (0, 4, type(value).__name__, value)
    return (0, 9, dumps_payload(json_safe(value)))


def numeric_columns(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> set[str]:
    """CSV columns whose every non-empty value is a number (sorted numerically, not as text)."""
    numeric = set()
    for col in columns:
        seen = False
        for row in rows:
            v = row.get(col)
            if v is None or v == "":
                continue
            try:
                f = float(v)
            except ValueError:
                break
            if math.isnan(f):
                break
            seen = True
        else:
            if seen:
                numeric.add(col)
    return numeric


def sorted_rows(
    rows: list[tuple[str, dict[str, Any]]], order_by: Sequence[str], csv_numeric: set[str]
) -> list[tuple[str, dict[str, Any]]]:
    def sort_key(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
        row = item[1]
        out = []
        for col in order_by:
            v = row.get(col)
            if col in csv_numeric and v not in (None, ""):
                v = float(v)
            out.append(sort_value(v))
        return tuple(out)

    try:
        return sorted(rows, key=sort_key)  # stable: equal rows keep their file order
    except TypeError as exc:  # pragma: no cover - values of one type always compare
        raise InputError(
            f"cannot sort by {', '.join(order_by)}: the columns hold values that do not "
            f"compare ({exc}); sort by columns with one type of value"
        ) from None
