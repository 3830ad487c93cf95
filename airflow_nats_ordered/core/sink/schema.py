"""The fenced sink's tables in the user's SQLite file, their version, and the move of files
written by an earlier version.

Tables (all keyed by ``(stream, grp, partition)``, so several groups and streams share one
file without seeing each other's state):

``nats_fence_state``    a partition's fence: highest token, last applied sequence, and how
                        much of its applied history is kept
``nats_fence_applied``  the last applied sequences (and their msg-ids) per partition
``nats_fence_audit``    every judged write (``apply``) and fence raise (``fence``), in one
                        id order

Guarantees: ``SCHEMA`` only creates what is missing (``IF NOT EXISTS``); a file of the
earlier, partition-keyed format is refused with the fix (:func:`refuse_partition_keyed`)
and only moved into one (stream, group) on explicit request
(:meth:`~.fenced.FencedSqliteSink.migrate_partition_keyed`, which runs
:func:`move_partition_keyed` in one transaction).
"""

from __future__ import annotations

import sqlite3

from airflow_nats_ordered.core.sink.errors import SinkUsageError

STATE_TABLE = "nats_fence_state"
APPLIED_TABLE = "nats_fence_applied"
AUDIT_TABLE = "nats_fence_audit"
SCHEMA_VERSION = 2

SCHEMA = (
    # remembered_from: every applied seq >= it is in APPLIED_TABLE; remembered: how many rows
    f"""CREATE TABLE IF NOT EXISTS {STATE_TABLE} (
        stream TEXT NOT NULL,
        grp TEXT NOT NULL,
        partition INTEGER NOT NULL,
        highest_token INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        remembered_from INTEGER NOT NULL DEFAULT 0,
        remembered INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (stream, grp, partition))""",
    f"""CREATE TABLE IF NOT EXISTS {APPLIED_TABLE} (
        stream TEXT NOT NULL,
        grp TEXT NOT NULL,
        partition INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        msg_id TEXT,
        PRIMARY KEY (stream, grp, partition, seq)) WITHOUT ROWID""",
    # kind 'apply': seq and verdict set. kind 'fence': seq NULL, verdict NULL, highest_token
    # is the fence after the raise. One table, so ids order applies and fences globally.
    f"""CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL,
        stream TEXT NOT NULL,
        grp TEXT NOT NULL,
        partition INTEGER NOT NULL,
        token INTEGER NOT NULL,
        seq INTEGER,
        verdict TEXT,
        highest_token INTEGER,
        at REAL NOT NULL,
        pid INTEGER NOT NULL)""",
)


def is_partition_keyed(conn: sqlite3.Connection) -> bool:
    """Whether the file holds fences of an earlier version (keyed by partition only)."""
    cols = {row[1] for row in conn.execute(f"PRAGMA table_info({STATE_TABLE})")}
    return bool(cols) and "stream" not in cols


def refuse_partition_keyed(conn: sqlite3.Connection, path: str) -> None:
    """Raise :class:`~.errors.SinkUsageError` (with the fix) for an earlier-format file."""
    if is_partition_keyed(conn):
        raise SinkUsageError(
            f"the sink database {path!r} was written by an earlier version that keyed fences "
            "by partition only, so they cannot be told apart by stream and group. If every "
            "fence in it belongs to one stream and group, migrate it once with "
            f"FencedSqliteSink.migrate_partition_keyed({path!r}, stream=..., group=...); "
            "otherwise start a new sink file"
        )


def move_partition_keyed(c: sqlite3.Connection, stream: str, group: str) -> int:
    """Inside the caller's write transaction: move a partition-keyed file's fences and audit
    into (``stream``, ``group``) and the current schema; the number of partitions moved
    (0 if the file is already in the current format)."""
    if not is_partition_keyed(c):
        return 0
    c.execute(f"ALTER TABLE {STATE_TABLE} RENAME TO {STATE_TABLE}_v1")
    c.execute(f"ALTER TABLE {AUDIT_TABLE} RENAME TO {AUDIT_TABLE}_v1")
    for ddl in SCHEMA:
        c.execute(ddl)
    moved = c.execute(
        f"INSERT INTO {STATE_TABLE} (stream, grp, partition, highest_token, "
        "last_seq, remembered_from) SELECT ?, ?, partition, highest_token, "
        f"last_seq, last_seq + 1 FROM {STATE_TABLE}_v1",
        (stream, group),
    ).rowcount
    c.execute(
        f"INSERT INTO {AUDIT_TABLE} (id, kind, stream, grp, partition, token, seq, "
        "verdict, highest_token, at, pid) SELECT id, kind, ?, ?, partition, token, "
        f"seq, verdict, highest_token, at, pid FROM {AUDIT_TABLE}_v1",
        (stream, group),
    )
    c.execute(f"DROP TABLE {STATE_TABLE}_v1")
    c.execute(f"DROP TABLE {AUDIT_TABLE}_v1")
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return moved
