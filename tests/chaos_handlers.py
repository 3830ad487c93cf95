"""Handlers run by the chaos tests' worker processes (imported via PYTHONPATH=tests).

``Recorder`` applies every message through the reference fenced sink, opened for the
worker's stream and group: the event row is written in the same transaction that advances
the partition's fence, and a write with a stale token is refused and stops the partition
(``Fenced``). If the file named by ``CHAOS_PAUSE_FILE`` appears, the member writes the
partition and token in hand to ``<that file>.paused`` and SIGSTOPs itself inside the
handler, after the worker's lease check, before the sink write and with no sink transaction
open: once resumed (SIGCONT) it is a zombie that certainly attempts one more write.

"No sink transaction open" needs care, because the member's other partitions keep calling
the sink from other threads. Every sink call holds ``_writing``, and the pause holds it
from before the stop until the test has resumed the member (:func:`resume` writes
``<that file>.resume`` just before SIGCONT). The stop is sent to the pausing thread itself
(``pthread_kill``): a process-directed ``kill(getpid(), SIGSTOP)`` is taken by the main
thread, and on a loaded machine the pausing thread used to return from ``kill``, release
the lock and let another partition begin its sink transaction before the main thread got
to stop the process. The paused member then held SQLite's write lock for the whole pause
(gdb on a stopped member: a thread inside ``COMMIT``; ``/proc/locks``: its WAL write lock),
so no other member could fence or write, and the test's wait for a newer owner's fence
timed out (7 of 30 loaded runs).

``ignore`` does nothing (members whose leases, not their writes, are under test).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.sink.fencing import Verdict

#: how long a paused member waits for the test's resume marker after SIGCONT (a bound on a
#: hang, should the marker never come)
RESUME_BOUND = 300.0

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
        with self._writing:  # no sink call of this process starts until the test resumed it
            with open(f"{self.pause_file}.paused", "w") as f:
                json.dump({"partition": msg.partition, "token": msg.fencing_token}, f)
            # this thread stops before its kill() returns (see the module's docstring)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            resumed = f"{self.pause_file}.resume"
            deadline = time.monotonic() + RESUME_BOUND
            while not os.path.exists(resumed) and time.monotonic() < deadline:
                time.sleep(0.01)

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


def resume(pause_file: str, pid: int) -> None:
    """Resume a member paused by ``CHAOS_PAUSE_FILE``: the marker its pause waits for, then
    SIGCONT (either order resumes it; the marker first lets it go on at once)."""
    with open(f"{pause_file}.resume", "w"):
        pass
    os.kill(pid, signal.SIGCONT)


def write_forever(partitions: int, *, slow_main: bool = False) -> None:
    """Feed ``partitions`` partitions' messages to a :class:`Recorder` at once, for ever, the
    way a member's partition tasks do (tests pause such a process and look at the sink).
    Stream, group and sink come from ``CHAOS_STREAM``, ``CHAOS_GROUP`` and ``CHAOS_SINK``.

    ``slow_main``: once the sink threads exist, the main thread (the event loop) runs at the
    lowest priority (nice 19, that thread only), as on a loaded machine where it waits for a
    CPU while the sink threads run."""
    from airflow_nats_ordered.core.stream.message import Message

    async def run() -> None:
        rec = Recorder(stream=os.environ["CHAOS_STREAM"], group=os.environ["CHAOS_GROUP"])
        await asyncio.gather(*(rec.on_assign(p, 1) for p in range(partitions)))
        if slow_main:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)

        async def feed(p: int) -> None:
            seq = 0
            while True:
                seq += 1
                data = json.dumps({"k": f"k{p}", "i": seq}).encode()
                await rec(Message(f"k{p}", data, {}, p, seq, 1, f"s.{p}"))

        await asyncio.gather(*(feed(p) for p in range(partitions)))

    asyncio.run(run())


def ignore(msg) -> None:
    """Do nothing with one message."""


class StuckClose:
    """A handler whose close() never returns in time (a sink waiting on a lock)."""

    def __call__(self, msg) -> None:
        pass

    def close(self) -> None:
        print("close() is stuck", flush=True)
        time.sleep(120)
