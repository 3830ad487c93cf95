"""Handlers run by the chaos tests' worker processes (imported via PYTHONPATH=tests).

``Recorder`` applies every message through the reference fenced sink, opened for the
worker's stream and group: the event row is written in the same transaction that advances
the partition's fence, and a write with a stale token is refused and stops the partition
(``Fenced``). If the file named by ``CHAOS_PAUSE_FILE`` appears, the member removes it and
SIGSTOPs itself inside the handler, after the worker's lease check and before the sink
write: once resumed (SIGCONT) it is a zombie that certainly attempts one more write.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
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

    def fencing_floor(self, partition: int) -> int:
        return self.sink.fencing_floor(partition)

    def _pause_if_asked(self) -> None:
        if self.pause_file and os.path.exists(self.pause_file):
            os.remove(self.pause_file)
            os.kill(os.getpid(), signal.SIGSTOP)

    # Sink calls block (SQLite locks, fsync): they run in a thread so the worker's event loop
    # keeps renewing leases even while another process holds the database lock.
    async def on_assign(self, partition: int, token: int) -> None:
        await asyncio.to_thread(self.sink.fence, partition, token)

    async def __call__(self, msg) -> None:
        d = json.loads(msg.data)
        self._pause_if_asked()

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


class StuckClose:
    """A handler whose close() never returns in time (a sink waiting on a lock)."""

    def __call__(self, msg) -> None:
        pass

    def close(self) -> None:
        print("close() is stuck", flush=True)
        time.sleep(120)
