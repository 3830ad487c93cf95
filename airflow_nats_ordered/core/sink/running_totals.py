"""Keyed running totals: a ready-made ``fn`` for the fenced sink (:class:`RunningTotals`).

Guarantees: each ``fn`` adds one event to one key (``count += 1`` and each amount column
``+= amount``) through the connection it is given, so inside
:meth:`~.fenced.FencedSqliteSink.apply` it is applied exactly when the sink applies the
message; an event id is a primary key, so applying one event twice fails loudly instead of
double counting. Bad names or amounts are refused with a ``ValueError`` naming them.
"""

from __future__ import annotations

import math
import re
import sqlite3
from typing import Any

from airflow_nats_ordered.core.sink.fenced import ApplyFn

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_RESERVED = {"key", "count", "event"}


def _check_ident(what: str, name: str) -> str:
    if not isinstance(name, str) or not _IDENT.match(name):
        raise ValueError(
            f"{what} {name!r} is not a plain SQL identifier; use letters, digits and _ "
            "(not starting with a digit, at most 63 characters)"
        )
    return name


class RunningTotals:
    """Keyed running totals, updated by the ``fn`` that :meth:`add` returns.

    Table ``<table>(key TEXT PRIMARY KEY, count INTEGER, <one column per amount>)``; with an
    ``event`` id, also one row in ``<table>_events(event TEXT PRIMARY KEY, key, count,
    <amounts>)`` holding the key's running values right after that event. Tables and amount
    columns are created on first use (new columns start at 0). Because ``event`` is a
    primary key, applying one event twice fails loudly (``sqlite3.IntegrityError``) instead
    of double counting.
    """

    def __init__(self, table: str = "totals") -> None:
        self.table = _check_ident("table name", table)
        self.events_table = f"{table}_events"

    def add(self, key: str, *, event: str | None = None, **amounts: float | None) -> ApplyFn:
        """An ``fn`` adding one event to ``key``: ``count += 1`` and each ``column += amount``.

        An amount of None adds nothing (like SQL ``SUM`` skipping NULL); the event still
        counts. Amounts must be finite ints or floats; ``key``, ``count`` and ``event`` are
        reserved column names.
        """
        if not isinstance(key, str):
            raise ValueError(f"a totals key must be a str, got {type(key).__name__}")
        if event is not None and not isinstance(event, str):
            raise ValueError(f"event must be a str id or None, got {type(event).__name__}")
        for col, val in amounts.items():
            _check_ident("amount column", col)
            if col.lower() in _RESERVED:
                raise ValueError(f"amount column {col!r} is reserved; rename it")
            if val is None:
                continue
            if isinstance(val, bool) or not isinstance(val, int | float):
                raise ValueError(f"amount {col}={val!r} must be an int, a float or None")
            if not math.isfinite(val):
                raise ValueError(f"amount {col}={val!r} is not finite; pass None for missing")
        cols = sorted(amounts)

        def fn(conn: sqlite3.Connection) -> None:
            self._ensure(conn, cols, with_events=event is not None)
            names = "".join(f', "{c}"' for c in cols)
            marks = ", ?" * len(cols)
            sets = "".join(f', "{c}" = "{c}" + excluded."{c}"' for c in cols)
            conn.execute(
                f'INSERT INTO "{self.table}" (key, count{names}) VALUES (?, 1{marks}) '
                f"ON CONFLICT(key) DO UPDATE SET count = count + 1{sets}",
                (key, *(amounts[c] if amounts[c] is not None else 0 for c in cols)),
            )
            if event is not None:
                all_cols = self._columns(conn, self.table)
                sel = ", ".join(f'"{c}"' for c in all_cols if c != "key")
                conn.execute(
                    f'INSERT INTO "{self.events_table}" (event, key, {sel}) '
                    f'SELECT ?, key, {sel} FROM "{self.table}" WHERE key = ?',
                    (event, key),
                )

        return fn

    @staticmethod
    def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
        return [row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')]

    def _ensure(self, conn: sqlite3.Connection, cols: list[str], *, with_events: bool) -> None:
        conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{self.table}" '
            "(key TEXT PRIMARY KEY, count INTEGER NOT NULL DEFAULT 0)"
        )
        if with_events:
            conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{self.events_table}" (event TEXT PRIMARY KEY, '
                "key TEXT NOT NULL, count INTEGER NOT NULL DEFAULT 0)"
            )
        have = set(self._columns(conn, self.table))
        # Every sum column exists in both tables, so the events row can copy them all.
        wanted = have.union(cols) - {"key", "count"}
        tables = [self.table, self.events_table] if with_events else [self.table]
        for table in tables:
            present = have if table == self.table else set(self._columns(conn, table))
            for c in sorted(wanted - present):
                conn.execute(f'ALTER TABLE "{table}" ADD COLUMN "{c}" NUMERIC NOT NULL DEFAULT 0')

    def totals(self, conn: sqlite3.Connection) -> dict[str, dict[str, Any]]:
        """``key -> {"count": n, <column>: sum, ...}`` (empty before the first event)."""
        return {row.pop("key"): row for row in self._rows(conn, self.table, "key")}

    def events(self, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        """Every event row (``event``, ``key``, running ``count`` and sums), in applied order."""
        return self._rows(conn, self.events_table, "rowid")

    def _rows(self, conn: sqlite3.Connection, table: str, order: str) -> list[dict[str, Any]]:
        cols = self._columns(conn, table)
        if not cols:
            return []
        cur = conn.execute(f'SELECT * FROM "{table}" ORDER BY {order}')
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur]


def add_to_totals(key: str, *, event: str | None = None, **amounts: float | None) -> ApplyFn:
    """``RunningTotals("totals").add(key, event=..., **amounts)``: an ``fn`` for ``apply``."""
    return RunningTotals().add(key, event=event, **amounts)
