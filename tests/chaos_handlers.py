"""Handlers run by the chaos tests' worker processes (imported via PYTHONPATH=tests).

``Recorder`` applies every message through the reference fenced sink, opened for the
worker's stream and group: the event row is written in the same transaction that advances
the partition's fence, and a write with a stale token is refused and stops the partition
(``Fenced``). If the file named by ``CHAOS_PAUSE_FILE`` appears, the member writes the
partition and token in hand to ``<that file>.paused`` and SIGSTOPs itself inside the
handler, after the worker's lease check, before the sink write and with no sink transaction
open: once resumed (SIGCONT) it is a zombie that certainly attempts one more write.

``ignore`` does nothing (members whose leases, not their writes, are under test).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

from airflow_nats_ordered.core.fenced_sink import FencedSqliteSink
from airflow_nats_ordered.core.fencing import Verdict
from airflow_nats_ordered.core.group import Fenced

EVENTS_DDL = (
    "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, k TEXT, i INTEGER, "
    "partition INTEGER, seq INTEGER, token INTEGER, member TEXT, at REAL)"
)


class Recorder:
    def __init__(self, *, stream: str, group: str) -> None:
        self.sink = FencedSqliteSink(os.environ["CHAOS_SINK"], stream=stream, group=group)
        self.member = os.environ.get("CHAOS_MEMBER", str(os.getpid()))
        self.delay = float(os.environ.get("CHAOS_DELAY", "0"))
        self.pause_file = os.environ.get("CHAOS_PAUSE_FILE")
        # held around every sink call, and while stopped: a pause never holds the database
        self._writing = threading.Lock()

    # async, in a thread: waiting for the database must never block the worker's event loop
    async def fencing_floor(self, partition: int) -> int:
        return await asyncio.to_thread(self._locked, self.sink.fencing_floor, partition)

    def _stop_between_writes(self, msg) -> None:
        with self._writing:
            with open(f"{self.pause_file}.paused", "w") as f:
                json.dump({"partition": msg.partition, "token": msg.fencing_token}, f)
            os.kill(os.getpid(), signal.SIGSTOP)

    def _locked(self, call, *args, **kwargs):
        with self._writing:
            return call(*args, **kwargs)

    # Sink calls block (SQLite locks, fsync): they run in a thread so the worker's event loop
    # keeps renewing leases even while another process holds the database lock.
    async def on_assign(self, partition: int, token: int) -> None:
        await asyncio.to_thread(self._locked, self.sink.fence, partition, token)

    async def __call__(self, msg) -> None:
        d = json.loads(msg.data)
        if self.pause_file and os.path.exists(self.pause_file):
            os.remove(self.pause_file)
            await asyncio.to_thread(self._stop_between_writes, msg)

        def write(conn) -> None:
            conn.execute(
                "INSERT INTO events (k, i, partition, seq, token, member, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    d["k"],
                    d["i"],
                    msg.partition,
                    msg.stream_seq,
                    msg.fencing_token,
                    self.member,
                    time.time(),
                ),
            )

        verdict = await asyncio.to_thread(
            self._locked,
            self.sink.apply,
            msg.partition,
            msg.fencing_token,
            msg.stream_seq,
            write,
            msg_id=msg.headers.get("Nats-Msg-Id"),
        )
        if verdict is Verdict.STALE_TOKEN:
            raise Fenced(f"sink refused token {msg.fencing_token} on partition {msg.partition}")
        if self.delay:
            await asyncio.sleep(self.delay)

    def close(self) -> None:
        self.sink.close()


def ignore(msg) -> None:
    """Do nothing with one message."""


class StuckClose:
    """A handler whose close() never returns in time (a sink waiting on a lock)."""

    def __call__(self, msg) -> None:
        pass

    def close(self) -> None:
        print("close() is stuck", flush=True)
        time.sleep(120)
