"""The handler the explorer's workers run: the chaos tests' fenced-sink ``Recorder``
(tests/chaos_handlers.py) that refuses poison records.

A record whose payload has ``"poison": true`` is refused (the worker retries, then
dead-letters it) unless it is a replay (header ``Nats-Ordered-Replay-Of``): a replayed
dead letter is applied like any record. Every applied record is one row of the sink's
``events`` table (key, the record's global id, partition, stream sequence, token, member).
Needs ``tests/`` on PYTHONPATH and ``CHAOS_SINK`` set (see chaos_handlers).

``GlobalRecorder`` is the handler of the global-order readers (``--global-order``).
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

from chaos_handlers import Recorder


class PoisonRefused(Exception):
    """A poison record, refused so that the worker dead-letters it."""


class PoisonRecorder(Recorder):
    async def __call__(self, msg: Any) -> None:
        if json.loads(msg.data).get("poison") and "Nats-Ordered-Replay-Of" not in msg.headers:
            raise PoisonRefused(f"poison record on partition {msg.partition}")
        await super().__call__(msg)


#: the table of ``GLOBAL_SINK``: one row per record a global-order reader handed over
HANDOVERS_DDL = (
    "CREATE TABLE IF NOT EXISTS handovers (id INTEGER PRIMARY KEY, reader TEXT, g INTEGER, "
    "k TEXT, producer TEXT, i INTEGER, partition INTEGER, seq INTEGER, token INTEGER)"
)


class GlobalRecorder:
    """The handler of the explorer's global-order readers (``--global-order``): appends each
    record handed over to the ``handovers`` table of the SQLite file ``$GLOBAL_SINK``, one
    committed transaction per record, before the reader counts it handled (so a reader
    killed after this write hands the record over again: the checker expects repeats, never
    a record recorded but not handed over). ``$GLOBAL_READER`` names the reader."""

    def __init__(self, *, stream: str, group: str) -> None:
        self.db = sqlite3.connect(
            os.environ["GLOBAL_SINK"], timeout=60, isolation_level=None, check_same_thread=False
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(HANDOVERS_DDL)
        self.reader = os.environ.get("GLOBAL_READER", str(os.getpid()))

    def __call__(self, msg: Any) -> None:
        d = json.loads(msg.data)
        self.db.execute(
            "INSERT INTO handovers (reader, g, k, producer, i, partition, seq, token) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                self.reader,
                msg.global_seq,
                msg.key,
                d.get("p"),
                d.get("i"),
                msg.partition,
                msg.stream_seq,
                msg.fencing_token,
            ),
        )

    def close(self) -> None:
        self.db.close()
