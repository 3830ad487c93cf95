"""What the fenced sink keeps of one partition in its file: the fence row (``STATE_TABLE``)
and the applied history (``APPLIED_TABLE``: the last applied sequences and their msg-ids).

Each function runs inside the caller's transaction and touches only the rows of one
(stream, group) ``scope`` and partition, so several groups and streams share one file.

Guarantees: every applied sequence at or above the row's ``remembered_from`` is in the
applied history (:func:`remember_applied` adds each one in the transaction that applies
it); :func:`forget_old` keeps at least the last ``remember`` of them and moves
``remembered_from`` up to the oldest one kept, so a sequence below it is known to be
forgotten (:func:`applied_before` answers None), never taken for one never applied.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from airflow_nats_ordered.core.sink.fencing import FenceState
from airflow_nats_ordered.core.sink.schema import APPLIED_TABLE, STATE_TABLE


@dataclass(frozen=True)
class PartitionRow:
    """A partition's row: its fence state and how much of its applied history is kept."""

    state: FenceState
    remembered_from: int = 0
    remembered: int = 0


def load(conn: sqlite3.Connection, scope: tuple[str, str], partition: int) -> PartitionRow:
    """The partition's row (an empty fence if it was never written)."""
    row = conn.execute(
        f"SELECT highest_token, last_seq, remembered_from, remembered FROM {STATE_TABLE} "
        "WHERE stream = ? AND grp = ? AND partition = ?",
        (*scope, partition),
    ).fetchone()
    return (
        PartitionRow(FenceState(row[0], row[1]), row[2], row[3])
        if row
        else PartitionRow(FenceState())
    )


def store(
    conn: sqlite3.Connection, scope: tuple[str, str], partition: int, stored: PartitionRow
) -> None:
    """Write the partition's row."""
    conn.execute(
        f"INSERT INTO {STATE_TABLE} (stream, grp, partition, highest_token, last_seq, "
        "remembered_from, remembered) VALUES (?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT(stream, grp, partition) DO UPDATE SET "
        "highest_token = excluded.highest_token, last_seq = excluded.last_seq, "
        "remembered_from = excluded.remembered_from, remembered = excluded.remembered",
        (
            *scope,
            partition,
            stored.state.highest_token,
            stored.state.last_seq,
            stored.remembered_from,
            stored.remembered,
        ),
    )


def applied_id(
    conn: sqlite3.Connection, scope: tuple[str, str], partition: int, seq: int
) -> tuple[str | None] | None:
    """The applied history's row of ``seq`` (its msg-id), or None if it holds none."""
    row: tuple[str | None] | None = conn.execute(
        f"SELECT msg_id FROM {APPLIED_TABLE} "
        "WHERE stream = ? AND grp = ? AND partition = ? AND seq = ?",
        (*scope, partition, seq),
    ).fetchone()
    return row


def applied_before(
    conn: sqlite3.Connection,
    scope: tuple[str, str],
    partition: int,
    stored: PartitionRow,
    seq: int,
    msg_id: str | None,
) -> tuple[bool | None, str | None]:
    """Whether ``seq`` (<= last_seq) was applied as this message: (answer, stored msg id).

    None if the sink no longer remembers ``seq``; a missing ``msg_id`` on either side
    matches any message (the sequence alone decides).
    """
    if seq < stored.remembered_from:
        return None, None
    row = applied_id(conn, scope, partition, seq)
    if row is None:
        return False, None
    return (msg_id is None or row[0] is None or row[0] == msg_id), row[0]


def remember_applied(
    conn: sqlite3.Connection, scope: tuple[str, str], partition: int, seq: int, msg_id: str | None
) -> None:
    """Add the applied ``seq`` (and its msg-id) to the applied history."""
    conn.execute(
        f"INSERT INTO {APPLIED_TABLE} (stream, grp, partition, seq, msg_id) VALUES (?, ?, ?, ?, ?)",
        (*scope, partition, seq, msg_id),
    )


def forget_old(
    conn: sqlite3.Connection,
    scope: tuple[str, str],
    partition: int,
    stored: PartitionRow,
    remember: int,
) -> PartitionRow:
    """Keep the last ``remember`` applied sequences once twice as many are stored."""
    if stored.remembered < 2 * remember:
        return stored
    (boundary,) = conn.execute(
        f"SELECT seq FROM {APPLIED_TABLE} WHERE stream = ? AND grp = ? AND partition = ? "
        "ORDER BY seq DESC LIMIT 1 OFFSET ?",
        (*scope, partition, remember - 1),
    ).fetchone()
    conn.execute(
        f"DELETE FROM {APPLIED_TABLE} WHERE stream = ? AND grp = ? AND partition = ? AND seq < ?",
        (*scope, partition, boundary),
    )
    return PartitionRow(stored.state, boundary, remember)


def forget_after(conn: sqlite3.Connection, scope: tuple[str, str], partition: int, seq: int) -> int:
    """Forget the applied sequences above ``seq``; the number of sequences still kept."""
    conn.execute(
        f"DELETE FROM {APPLIED_TABLE} WHERE stream = ? AND grp = ? AND partition = ? AND seq > ?",
        (*scope, partition, seq),
    )
    kept: int = conn.execute(
        f"SELECT COUNT(*) FROM {APPLIED_TABLE} WHERE stream = ? AND grp = ? AND partition = ?",
        (*scope, partition),
    ).fetchone()[0]
    return kept
