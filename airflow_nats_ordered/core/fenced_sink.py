"""A reference fenced sink on SQLite: exactly-once effects across owner changes.

:class:`FencedSqliteSink` stores each partition's :class:`~.fencing.FenceState` next to the
user's own tables, in the same database file, and applies every message in one
``BEGIN IMMEDIATE`` transaction that

1. judges ``(token, seq)`` against the stored state (:func:`~.fencing.judge`),
2. on ``APPLY`` runs the user's ``fn(conn)`` (their writes) and stores the advanced state,
3. records the outcome in the audit table,

and commits all of it or nothing. Hence, whatever the workers do (crash after applying but
before acking, get paused past their lease, run twice):

* a message's writes happen at most once per partition sequence, and in sequence order;
* after a new owner has called :meth:`FencedSqliteSink.fence` with its token, nothing an
  older owner sends is applied;
* if ``fn`` raises, neither its writes nor the fence state nor the audit row are kept.

Several processes may use one file at once, each with its own :class:`FencedSqliteSink`
(never share a connection across processes): the database runs in WAL mode, writers
serialize on ``BEGIN IMMEDIATE`` with a busy timeout, and a "database is locked" answer is
retried until ``timeout`` seconds have passed (then :class:`SinkBusyError`). One object may
be used from several threads (calls are serialized by a lock).

:class:`RunningTotals` (and :func:`add_to_totals`) is a ready-made ``fn``: a keyed table of
running counts and sums, plus an optional per-event row holding the running values right
after that event.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import NatsOrderedError
from .fencing import FenceState, Verdict, advance, judge, raise_fence

T = TypeVar("T")
ApplyFn = Callable[[sqlite3.Connection], None]

STATE_TABLE = "nats_fence_state"
AUDIT_TABLE = "nats_fence_audit"

_SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS {STATE_TABLE} (
        partition INTEGER PRIMARY KEY,
        highest_token INTEGER NOT NULL,
        last_seq INTEGER NOT NULL)""",
    # kind 'apply': seq and verdict set. kind 'fence': seq NULL, verdict NULL, highest_token
    # is the fence after the raise. One table, so ids order applies and fences globally.
    f"""CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL,
        partition INTEGER NOT NULL,
        token INTEGER NOT NULL,
        seq INTEGER,
        verdict TEXT,
        highest_token INTEGER,
        at REAL NOT NULL,
        pid INTEGER NOT NULL)""",
)


class SinkBusyError(NatsOrderedError, TimeoutError):
    """The sink database stayed locked by another writer for longer than ``timeout``."""


class SinkUsageError(NatsOrderedError):
    """The sink was used in a way that would break its guarantees (see the message)."""


@dataclass(frozen=True)
class AuditRow:
    """One judged write. ``id`` orders rows (and :class:`FenceEvent` s) in commit order."""

    id: int
    partition: int
    token: int
    seq: int
    verdict: Verdict
    applied_at: float
    pid: int


@dataclass(frozen=True)
class FenceEvent:
    """One :meth:`FencedSqliteSink.fence` call; ``highest_token`` is the fence afterwards."""

    id: int
    partition: int
    token: int
    highest_token: int
    raised_at: float
    pid: int


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _reopen(path: str, timeout: float) -> FencedSqliteSink:
    return FencedSqliteSink(path, timeout=timeout)


class FencedSqliteSink:
    """A fenced sink on one SQLite file; see the module doc for the guarantees.

    ``timeout`` (seconds) bounds how long one call waits for other writers. Pickling the
    object (e.g. to a ``spawn`` child process) reopens the same file in the receiver.
    """

    def __init__(self, path: str | Path, *, timeout: float = 30.0) -> None:
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.path = str(path)
        self.timeout = float(timeout)
        self._lock = threading.RLock()
        try:
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise SinkUsageError(
                f"cannot open the sink database {self.path!r}: {exc}; check that its "
                "directory exists and is writable"
            ) from None
        try:
            conn = self._conn
            conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
            self._retry_busy(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
            # FULL: a committed fence or applied message survives power loss too.
            conn.execute("PRAGMA synchronous = FULL")
            with self._write_txn() as c:
                for ddl in _SCHEMA:
                    c.execute(ddl)
        except BaseException:
            self.close()
            raise

    # -- plumbing ------------------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (self.path, self.timeout))

    def __enter__(self) -> FencedSqliteSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FencedSqliteSink({self.path!r})"

    def close(self) -> None:
        """Close the connection; idempotent. Later calls raise :class:`SinkUsageError`."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SinkUsageError(f"{self!r} is closed; open a new FencedSqliteSink")
        return self._conn

    def _retry_busy(self, op: Callable[[], T]) -> T:
        """Run ``op``; retry it while the database is locked, up to ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                return op()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SinkBusyError(
                        f"the sink database {self.path!r} stayed locked by another writer for "
                        f"{self.timeout:g}s ({exc}); raise timeout= or find the process "
                        "holding a long write transaction"
                    ) from exc
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.05)

    @contextmanager
    def _write_txn(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction: committed if the body returns, else rolled back."""
        with self._lock:
            conn = self._connection()
            self._retry_busy(lambda: conn.execute("BEGIN IMMEDIATE"))
            try:
                yield conn
                if not conn.in_transaction:
                    raise SinkUsageError(
                        "the transaction was ended inside fn (commit/rollback/COMMIT); fn must "
                        "only write: the sink commits your writes together with the fence state"
                    )
                self._retry_busy(lambda: conn.execute("COMMIT"))
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    @staticmethod
    def _load(conn: sqlite3.Connection, partition: int) -> FenceState:
        row = conn.execute(
            f"SELECT highest_token, last_seq FROM {STATE_TABLE} WHERE partition = ?", (partition,)
        ).fetchone()
        return FenceState(*row) if row else FenceState()

    @staticmethod
    def _store(conn: sqlite3.Connection, partition: int, state: FenceState) -> None:
        conn.execute(
            f"INSERT INTO {STATE_TABLE} (partition, highest_token, last_seq) VALUES (?, ?, ?) "
            "ON CONFLICT(partition) DO UPDATE SET "
            "highest_token = excluded.highest_token, last_seq = excluded.last_seq",
            (partition, state.highest_token, state.last_seq),
        )

    @staticmethod
    def _audit(conn: sqlite3.Connection, partition: int, token: int, seq: int, v: Verdict) -> None:
        conn.execute(
            f"INSERT INTO {AUDIT_TABLE} (kind, partition, token, seq, verdict, at, pid) "
            "VALUES ('apply', ?, ?, ?, ?, ?, ?)",
            (partition, token, seq, v.value, time.time(), os.getpid()),
        )

    def _run_user_fn(self, conn: sqlite3.Connection, fn: ApplyFn, seq: int) -> None:
        """Run ``fn(conn)`` with BEGIN/COMMIT/ROLLBACK denied, so it cannot split the transaction.

        (SAVEPOINTs stay allowed: they nest inside the sink's transaction.)
        """
        denied: list[str] = []

        def authorizer(action: int, arg1: str | None, *_: object) -> int:
            if action == sqlite3.SQLITE_TRANSACTION:
                denied.append(arg1 or "?")
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        conn.set_authorizer(authorizer)
        try:
            fn(conn)
        except sqlite3.DatabaseError as exc:
            if denied:
                raise SinkUsageError(
                    f"fn for seq {seq} tried to {denied[0]} the transaction; fn must only "
                    "write: the sink commits your writes together with the fence state"
                ) from exc
            raise
        finally:
            conn.set_authorizer(None)
        if denied or not conn.in_transaction:
            raise SinkUsageError(
                f"fn for seq {seq} ended the transaction; fn must only write: the sink "
                "commits your writes together with the fence state"
            )

    # -- the API ---------------------------------------------------------------------------

    def fence(self, partition: int, token: int) -> None:
        """Raise ``partition``'s fence to ``token`` (never lowers it); durable on return.

        A new owner calls this on grant, before processing: from then on no write with a
        lower token is applied.
        """
        _check_int("partition", partition, 0)
        _check_int("token", token, 0)
        with self._write_txn() as conn:
            state = raise_fence(self._load(conn, partition), token)
            self._store(conn, partition, state)
            conn.execute(
                f"INSERT INTO {AUDIT_TABLE} (kind, partition, token, highest_token, at, pid) "
                "VALUES ('fence', ?, ?, ?, ?, ?)",
                (partition, token, state.highest_token, time.time(), os.getpid()),
            )

    def apply(self, partition: int, token: int, seq: int, fn: ApplyFn | None = None) -> Verdict:
        """Judge ``(token, seq)`` and, on APPLY, run ``fn(conn)`` - all in one transaction.

        Returns the verdict: APPLY (``fn`` ran and is committed), DUPLICATE (already applied:
        ack the message), STALE_TOKEN (fenced off: stop processing the partition). If ``fn``
        raises, everything is rolled back and the exception propagates. ``fn`` must only
        write through ``conn`` and must not commit or roll back.
        """
        return self.apply_batch(partition, token, [(seq, fn)])[0]

    def apply_batch(
        self, partition: int, token: int, items: list[tuple[int, ApplyFn | None]]
    ) -> list[Verdict]:
        """:meth:`apply` for several messages of one partition in ONE transaction.

        Items are judged in order against the state as the batch advances it, so a repeated
        or out-of-order seq inside the batch is a DUPLICATE. One verdict per item. If any
        ``fn`` raises, the whole batch is rolled back and the exception propagates.
        """
        _check_int("partition", partition, 0)
        _check_int("token", token, 0)
        for seq, fn in items:
            _check_int("seq", seq, 1)
            if fn is not None and not callable(fn):
                raise ValueError(f"fn for seq {seq} must be callable(conn) or None, got {fn!r}")
        verdicts: list[Verdict] = []
        with self._write_txn() as conn:
            state = self._load(conn, partition)
            start = state
            for seq, fn in items:
                verdict = judge(state, token, seq)
                if verdict is Verdict.APPLY:
                    if fn is not None:
                        self._run_user_fn(conn, fn, seq)
                    state = advance(state, token, seq)
                self._audit(conn, partition, token, seq, verdict)
                verdicts.append(verdict)
            if state != start:
                self._store(conn, partition, state)
        return verdicts

    def state(self, partition: int) -> FenceState:
        """The committed fence state of ``partition`` (``FenceState()`` if never written)."""
        _check_int("partition", partition, 0)
        return self.read(lambda conn: self._load(conn, partition))

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` on one consistent snapshot and return its result; nothing is kept."""
        with self._lock:
            conn = self._connection()
            self._retry_busy(lambda: conn.execute("BEGIN"))
            try:
                return fn(conn)
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")

    def audit(self, partition: int | None = None) -> list[AuditRow]:
        """Every judged write (optionally of one partition), in commit order."""
        where, args = ("AND partition = ?", (partition,)) if partition is not None else ("", ())
        rows = self.read(
            lambda c: c.execute(
                f"SELECT id, partition, token, seq, verdict, at, pid FROM {AUDIT_TABLE} "
                f"WHERE kind = 'apply' {where} ORDER BY id",
                args,
            ).fetchall()
        )
        return [AuditRow(i, p, t, s, Verdict(v), at, pid) for i, p, t, s, v, at, pid in rows]

    def fence_log(self, partition: int | None = None) -> list[FenceEvent]:
        """Every :meth:`fence` call (optionally of one partition), in commit order."""
        where, args = ("AND partition = ?", (partition,)) if partition is not None else ("", ())
        rows = self.read(
            lambda c: c.execute(
                f"SELECT id, partition, token, highest_token, at, pid FROM {AUDIT_TABLE} "
                f"WHERE kind = 'fence' {where} ORDER BY id",
                args,
            ).fetchall()
        )
        return [FenceEvent(*row) for row in rows]


# -- a ready-made fn: keyed running totals ---------------------------------------------------

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
