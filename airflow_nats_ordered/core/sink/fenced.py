"""A reference fenced sink on SQLite: exactly-once effects across owner changes.

:class:`FencedSqliteSink` is opened for one consumer group of one stream
(``FencedSqliteSink(path, stream=..., group=...)``) and stores each of its partitions'
:class:`~.fencing.FenceState` next to the user's own tables, in the same database file,
keyed by (stream, group, partition): several groups and streams may share one file without
seeing each other's tokens or sequences. It applies every message in one ``BEGIN IMMEDIATE``
transaction that

1. judges ``(token, seq)`` against the stored state (:func:`~.fencing.judge`),
2. on ``APPLY`` runs the user's ``fn(conn)`` (their writes) and stores the advanced state,
3. records the outcome in the audit table,

and commits all of it or nothing. Hence, whatever the workers do (crash after applying but
before acking, get paused past their lease, run twice):

* a message's writes happen at most once per partition sequence, and in sequence order;
* after a new owner has called :meth:`FencedSqliteSink.fence` with its token, nothing an
  older owner sends is applied;
* a sequence at or below the last applied one is acknowledged as a DUPLICATE only if it is
  a re-delivery of a message the sink applied (same sequence, and the same ``msg_id`` when
  one is given); otherwise the call raises :class:`SinkOrderError` and applies nothing.
  The sink remembers the last ``remember`` applied sequences per partition (at least);
  an older one is taken for a re-delivery;
* if ``fn`` raises, neither its writes nor the fence state nor the audit row are kept.

Several processes may use one file at once, each with its own :class:`FencedSqliteSink`
(never share a connection across processes): the database runs in WAL mode, writers
serialize on ``BEGIN IMMEDIATE`` with a busy timeout, and a "database is locked" answer is
retried until ``timeout`` seconds have passed (then :class:`SinkBusyError`). One object may
be used from several threads (calls are serialized by a lock).

A file written by an earlier version (fences keyed by partition only) is refused;
:meth:`FencedSqliteSink.migrate_partition_keyed` moves it into one (stream, group).

Around the sink, each in its own module: :mod:`.fencing` (the rule every write is judged
by), :mod:`.partition_rows` (a partition's fence row and applied history in the file),
:mod:`.schema` (its tables, schema version and the earlier format's migration),
:mod:`.audit` (:class:`~.audit.AuditRow`, :class:`~.audit.FenceEvent`) and :mod:`.errors`
(:class:`~.errors.SinkBusyError`, :class:`~.errors.SinkUsageError`,
:class:`~.errors.SinkOrderError`). :mod:`.running_totals` builds on the sink: a ready-made
``fn`` (a keyed table of running counts and sums, plus an optional per-event row holding
the running values right after that event).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from airflow_nats_ordered.core.sink import partition_rows as rows
from airflow_nats_ordered.core.sink.audit import (
    AuditRow,
    FenceEvent,
    audit_query,
    record_apply,
    record_fence,
)
from airflow_nats_ordered.core.sink.errors import SinkBusyError, SinkOrderError, SinkUsageError
from airflow_nats_ordered.core.sink.fencing import FenceState, Verdict, advance, judge, raise_fence
from airflow_nats_ordered.core.sink.partition_rows import PartitionRow
from airflow_nats_ordered.core.sink.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    move_partition_keyed,
    refuse_partition_keyed,
)
from airflow_nats_ordered.core.stream.continuity import delivered_id

T = TypeVar("T")
ApplyFn = Callable[[sqlite3.Connection], None]
#: one message of :meth:`FencedSqliteSink.apply_batch`: ``(seq, fn)`` or ``(seq, fn, msg_id)``
BatchItem = tuple[int, ApplyFn | None] | tuple[int, ApplyFn | None, str | None]


class _OutOfOrder(Exception):  # noqa: N818 - internal: carries the refused item out of the txn
    def __init__(self, seq: int, token: int, message: str) -> None:
        super().__init__(message)
        self.seq, self.token, self.message = seq, token, message


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str (the worker's --{name}), got {value!r}")
    return value


def _reopen(path: str, stream: str, group: str, timeout: float, remember: int) -> FencedSqliteSink:
    return FencedSqliteSink(path, stream=stream, group=group, timeout=timeout, remember=remember)


class FencedSqliteSink:
    """A fenced sink on one SQLite file for one (``stream``, ``group``); see the module doc.

    ``timeout`` (seconds) bounds how long one call waits for other writers. ``remember``
    is how many of the last applied sequences per partition (at least) are kept to tell a
    re-delivery from a message that arrives out of order; keep it above the most messages
    a member applies between two commits. Pickling the object (e.g. to a ``spawn`` child
    process) reopens the same file and scope in the receiver.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        stream: str,
        group: str,
        timeout: float = 30.0,
        remember: int = 10_000,
    ) -> None:
        self.stream = _check_name("stream", stream)
        self.group = _check_name("group", group)
        self.remember = _check_int("remember", remember, 1)
        self._connect(path, timeout)
        try:
            with self._write_txn() as c:
                refuse_partition_keyed(c, self.path)
                for ddl in SCHEMA:
                    c.execute(ddl)
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            self.close()
            raise

    def _connect(self, path: str | Path, timeout: float) -> None:
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.path = str(path)
        self.timeout = float(timeout)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        try:
            self._conn = sqlite3.connect(
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
        except BaseException:
            self.close()
            raise

    @staticmethod
    def migrate_partition_keyed(
        path: str | Path, *, stream: str, group: str, timeout: float = 30.0
    ) -> int:
        """Move the fences of a file written by an earlier version into (stream, group).

        Earlier versions keyed fences by partition only. Call this once, only if every fence
        in ``path`` belongs to ``stream`` and ``group``; it returns the number of partitions
        moved. Their earlier sequences are not remembered (a re-delivery of one is taken as
        a DUPLICATE, as before). A file already in the current format is left as it is (0).
        """
        _check_name("stream", stream)
        _check_name("group", group)
        sink = object.__new__(FencedSqliteSink)  # a connection only: no schema check
        sink._connect(path, timeout)
        try:
            with sink._write_txn() as c:
                return move_partition_keyed(c, stream, group)
        finally:
            sink.close()

    # -- plumbing ------------------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (self.path, self.stream, self.group, self.timeout, self.remember))

    def __enter__(self) -> FencedSqliteSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FencedSqliteSink({self.path!r}, stream={self.stream!r}, group={self.group!r})"

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

    @property
    def _scope(self) -> tuple[str, str]:
        return (self.stream, self.group)

    def _audit(
        self, conn: sqlite3.Connection, partition: int, token: int, seq: int, v: Verdict
    ) -> None:
        record_apply(conn, self._scope, partition, token, seq, v)

    def _out_of_order(
        self, partition: int, seq: int, state: FenceState, msg_id: str | None, was: str | None
    ) -> str:
        where = f"partition {partition} of stream {self.stream}, group {self.group}"
        if was is not None:
            return (
                f"{where}: seq {seq} was applied as message {was!r} but this is {msg_id!r}: "
                "the stream was deleted and re-created under the same name (its sequences "
                "started again); nothing was applied. Use a new group name or a new sink file "
                "for the new stream"
            )
        return (
            f"{where}: seq {seq} arrived after seq {state.last_seq} was applied, but was never "
            "applied itself: the messages reached the sink out of order (a gap or reorder "
            "upstream, or a re-created stream); nothing was applied. Skipping it would lose it "
            "and applying it would break the order: find the cause in the worker's log before "
            "moving the partition on (a re-created stream needs a new group or sink file)"
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
            stored = rows.load(conn, self._scope, partition)
            state = raise_fence(stored.state, token)
            row = PartitionRow(state, stored.remembered_from, stored.remembered)
            rows.store(conn, self._scope, partition, row)
            record_fence(conn, self._scope, partition, token, state.highest_token)

    def rewind(self, to: Mapping[int, int], fn: ApplyFn | None = None) -> None:
        """Take partitions back for a deliberate replay (after the group was reset to the
        same positions): in ONE transaction with ``fn(conn)``, which must undo the user's own
        effects of the forgotten messages, each partition ``p``'s last applied sequence
        becomes ``to[p]`` and the applied sequences it remembers above it are forgotten, so
        they are applied again instead of being taken for re-deliveries. The fence (highest
        token) is kept: tokens never go back. Call it while the group is idle."""
        for p, seq in to.items():
            _check_int("partition", p, 0)
            _check_int("sequence", seq, 0)
        with self._write_txn() as conn:
            if fn is not None:
                self._run_user_fn(conn, fn, min(to.values(), default=0))
            for p, seq in to.items():
                stored = rows.load(conn, self._scope, p)
                if seq >= stored.state.last_seq:
                    continue  # nothing after it was applied
                kept = rows.forget_after(conn, self._scope, p, seq)
                state = FenceState(stored.state.highest_token, seq)
                row = PartitionRow(state, min(stored.remembered_from, seq + 1), kept)
                rows.store(conn, self._scope, p, row)

    def fencing_floor(self, partition: int) -> int:
        """The highest fencing token this sink has seen for ``partition`` (0 if none).

        A worker grants ``partition`` only with a larger token, so even if the group's
        commit record was lost, the sink never refuses the new owner and accepts an old one.
        """
        return self.state(partition).highest_token

    def applied_position(self, partition: int) -> tuple[int, str | None] | None:
        """``(last applied sequence, its msg_id)`` of ``partition``, or None if nothing was
        applied (the msg_id is None if ``apply`` was not given one, or it is forgotten).

        A worker checks it when it is granted the partition: if the stream no longer holds
        that message there (its stored state went back and the sequence was given to a new
        record), it stops the partition and reports it instead of having this sink take
        the new records for re-deliveries or refuse them."""
        _check_int("partition", partition, 0)

        def read(conn: sqlite3.Connection) -> tuple[int, str | None] | None:
            last = rows.load(conn, self._scope, partition).state.last_seq
            if last == 0:
                return None
            row = rows.applied_id(conn, self._scope, partition, last)
            return last, (row[0] if row else None)

        return self.read(read)

    def apply(
        self,
        partition: int,
        token: int,
        seq: int,
        fn: ApplyFn | None = None,
        *,
        msg_id: str | None = None,
    ) -> Verdict:
        """Judge ``(token, seq)`` and, on APPLY, run ``fn(conn)`` - all in one transaction.

        Returns the verdict: APPLY (``fn`` ran and is committed), DUPLICATE (a re-delivery
        of a message already applied: ack it), STALE_TOKEN (fenced off: stop processing the
        partition). Raises :class:`SinkOrderError` for a ``seq`` at or below the last applied
        one that is not a re-delivery. ``msg_id`` is the message's identity (its
        ``Nats-Msg-Id`` header): given, a different message under an applied ``seq`` is
        refused too; without one, the id of the message a worker is handing to the calling
        handler under ``seq`` is used (:data:`~..stream.continuity.delivering`), if any. If ``fn``
        raises, everything is rolled back and the exception propagates. ``fn`` must only write
        through ``conn`` and must not commit or roll back.
        """
        return self.apply_batch(partition, token, [(seq, fn, msg_id)])[0]

    def apply_batch(self, partition: int, token: int, items: Sequence[BatchItem]) -> list[Verdict]:
        """:meth:`apply` for several messages of one partition in ONE transaction.

        Items are ``(seq, fn)`` or ``(seq, fn, msg_id)``, judged in order against the state
        as the batch advances it, so a repeated seq inside the batch is a DUPLICATE. One
        verdict per item. If any ``fn`` raises, or any item is out of order
        (:class:`SinkOrderError`), nothing of the batch is kept and the exception propagates.
        """
        _check_int("partition", partition, 0)
        _check_int("token", token, 0)
        writes = [(item[0], item[1], item[2] if len(item) > 2 else None) for item in items]
        for seq, fn, msg_id in writes:
            _check_int("seq", seq, 1)
            if fn is not None and not callable(fn):
                raise ValueError(f"fn for seq {seq} must be callable(conn) or None, got {fn!r}")
            if msg_id is not None and not isinstance(msg_id, str):
                raise ValueError(f"msg_id for seq {seq} must be a str or None, got {msg_id!r}")
        # without a msg_id: the id of the message the worker is handing over under this seq
        writes = [(s, f, i or delivered_id(partition, s)) for s, f, i in writes]
        try:
            with self._write_txn() as conn:
                return self._judge_batch(conn, partition, token, writes)
        except _OutOfOrder as refused:
            with self._write_txn() as conn:  # the refusal is audited; nothing else is kept
                self._audit(conn, partition, refused.token, refused.seq, Verdict.OUT_OF_ORDER)
            raise SinkOrderError(refused.message, partition=partition, seq=refused.seq) from None

    def _judge_batch(
        self,
        conn: sqlite3.Connection,
        partition: int,
        token: int,
        writes: list[tuple[int, ApplyFn | None, str | None]],
    ) -> list[Verdict]:
        stored = start = rows.load(conn, self._scope, partition)
        verdicts: list[Verdict] = []
        for seq, fn, msg_id in writes:
            applied, was = None, None
            if seq <= stored.state.last_seq and token >= stored.state.highest_token:
                applied, was = rows.applied_before(
                    conn, self._scope, partition, stored, seq, msg_id
                )
            verdict = judge(stored.state, token, seq, applied=applied)
            if verdict is Verdict.OUT_OF_ORDER:
                raise _OutOfOrder(
                    seq, token, self._out_of_order(partition, seq, stored.state, msg_id, was)
                )
            if verdict is Verdict.APPLY:
                if fn is not None:
                    self._run_user_fn(conn, fn, seq)
                rows.remember_applied(conn, self._scope, partition, seq, msg_id)
                stored = PartitionRow(
                    advance(stored.state, token, seq), stored.remembered_from, stored.remembered + 1
                )
            self._audit(conn, partition, token, seq, verdict)
            verdicts.append(verdict)
        if stored != start:
            kept = rows.forget_old(conn, self._scope, partition, stored, self.remember)
            rows.store(conn, self._scope, partition, kept)
        return verdicts

    def state(self, partition: int) -> FenceState:
        """The committed fence state of ``partition`` (``FenceState()`` if never written)."""
        _check_int("partition", partition, 0)
        return self.read(lambda conn: rows.load(conn, self._scope, partition).state)

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

    def _audit_rows(self, kind: str, cols: str, partition: int | None) -> list[tuple]:
        sql, args = audit_query(kind, cols, self._scope, partition)
        return self.read(lambda c: c.execute(sql, args).fetchall())

    def audit(self, partition: int | None = None) -> list[AuditRow]:
        """Every judged write of this (stream, group) (optionally of one partition), in
        commit order."""
        rows = self._audit_rows("apply", "id, partition, token, seq, verdict, at, pid", partition)
        return [AuditRow(i, p, t, s, Verdict(v), at, pid) for i, p, t, s, v, at, pid in rows]

    def fence_log(self, partition: int | None = None) -> list[FenceEvent]:
        """Every :meth:`fence` call of this (stream, group) (optionally of one partition), in
        commit order."""
        rows = self._audit_rows("fence", "id, partition, token, highest_token, at, pid", partition)
        return [FenceEvent(*row) for row in rows]
