"""The handler the explorer's workers run: the chaos tests' fenced-sink ``Recorder``
(tests/chaos_handlers.py) that refuses poison records.

A record whose payload has ``"poison": true`` is refused (the worker retries, then
dead-letters it) unless it is a replay (header ``Nats-Ordered-Replay-Of``): a replayed
dead letter is applied like any record. Every applied record is one row of the sink's
``events`` table (key, the record's global id, partition, stream sequence, token, member).
Needs ``tests/`` on PYTHONPATH and ``CHAOS_SINK`` set (see chaos_handlers).
"""

from __future__ import annotations

import json
from typing import Any

from chaos_handlers import Recorder


class PoisonRefused(Exception):
    """A poison record, refused so that the worker dead-letters it."""


class PoisonRecorder(Recorder):
    async def __call__(self, msg: Any) -> None:
        if json.loads(msg.data).get("poison") and "Nats-Ordered-Replay-Of" not in msg.headers:
            raise PoisonRefused(f"poison record on partition {msg.partition}")
        await super().__call__(msg)
