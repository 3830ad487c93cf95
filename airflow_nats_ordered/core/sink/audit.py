"""The fenced sink's audit: every judged write and every fence raise, in commit order.

Guarantees: an audit row is written in the same transaction as the verdict it records
(and a refused OUT_OF_ORDER message in its own), so the audit never shows a write the
sink did not keep nor misses one it kept; ids order applies and fences globally.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass

from airflow_nats_ordered.core.sink.fencing import Verdict
from airflow_nats_ordered.core.sink.schema import AUDIT_TABLE


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


def record_apply(
    conn: sqlite3.Connection,
    scope: tuple[str, str],
    partition: int,
    token: int,
    seq: int,
    v: Verdict,
) -> None:
    """Record one judged write of (stream, group) ``scope`` in the caller's transaction."""
    conn.execute(
        f"INSERT INTO {AUDIT_TABLE} (kind, stream, grp, partition, token, seq, verdict, at, "
        "pid) VALUES ('apply', ?, ?, ?, ?, ?, ?, ?, ?)",
        (*scope, partition, token, seq, v.value, time.time(), os.getpid()),
    )


def record_fence(
    conn: sqlite3.Connection,
    scope: tuple[str, str],
    partition: int,
    token: int,
    highest_token: int,
) -> None:
    """Record one fence raise (``highest_token``: the fence afterwards) in the caller's
    transaction."""
    conn.execute(
        f"INSERT INTO {AUDIT_TABLE} (kind, stream, grp, partition, token, "
        "highest_token, at, pid) VALUES ('fence', ?, ?, ?, ?, ?, ?, ?)",
        (*scope, partition, token, highest_token, time.time(), os.getpid()),
    )


def audit_query(
    kind: str, cols: str, scope: tuple[str, str], partition: int | None
) -> tuple[str, list[object]]:
    """The SELECT (and its arguments) of ``cols`` of every ``kind`` row of ``scope``
    (optionally of one partition), in commit order."""
    where = "WHERE kind = ? AND stream = ? AND grp = ?"
    args: list[object] = [kind, *scope]
    if partition is not None:
        where, args = f"{where} AND partition = ?", [*args, partition]
    return f"SELECT {cols} FROM {AUDIT_TABLE} {where} ORDER BY id", args
