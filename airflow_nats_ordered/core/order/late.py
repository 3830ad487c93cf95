"""Setting a late record aside (the time-window mode's ``late="dead-letter"``,
:meth:`DeadLetters.set_aside`), with the conventions of a worker's dead letters
(:mod:`..worker.dead_letters`): subject ``<prefix>.dlq.<group>.<partition>`` in the stream
``<STREAM>_DLQ``, the record's headers plus why (``Nats-Ordered-Error``) and where it came
from (``Nats-Ordered-Origin``), a msg-id prefixed with the group.

Guarantee: True only once the server stored it; while publishing fails it is retried with
capped backoff (the reader hands nothing over meanwhile), and a reader that is stopping
gives up (False: the record was not set aside, its partition's position stays before it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR, HDR_ORIGIN, dead_letter_subject

log = logging.getLogger(__name__)


async def ensure_dead_letter_stream(nc: NATS, stream: PartitionedStream) -> None:
    """Create ``<STREAM>_DLQ`` for the dead-letter subjects of ``stream`` unless it exists."""
    js = jetstream(nc)
    name = f"{stream.name}_DLQ"
    try:
        await js.stream_info(name)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(
            name=name,
            subjects=[f"{stream.prefix}.dlq.>"],
            storage=api.StorageType.FILE,
            num_replicas=stream.replicas,
            duplicate_window=stream.duplicate_window or 120,
        )
    except NatsError:
        with contextlib.suppress(NotFoundError):
            await js.stream_info(name)
            return  # created concurrently
        raise


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """Where one global-order reader sets records aside: the dead-letter subjects of
    ``stream`` for its group (``group``), under its fencing token (``token``)."""

    nc: NATS
    stream: PartitionedStream
    group: GroupConfig
    token: int

    async def set_aside(self, p: int, item: Any, reason: str, stopping: Callable[[], bool]) -> bool:
        """Publish the record ``item`` ``(seq, msg, headers, key)`` of partition ``p`` to its
        dead-letter subject, saying why (``reason``); retried until stored, or until
        ``stopping()`` (False: not set aside)."""
        seq, m, headers, _ = item
        cfg = self.group
        h = dict(headers)
        h[HDR_ERROR] = reason
        h[HDR_ORIGIN] = json.dumps(
            {
                "stream": cfg.stream,
                "group": cfg.group,
                "partition": p,
                "seq": seq,
                "token": self.token,
            }
        )
        if "Nats-Msg-Id" in h:
            h["Nats-Msg-Id"] = f"{cfg.group}:{h['Nats-Msg-Id']}"
        subject = dead_letter_subject(self.stream.prefix, cfg.group, p)
        delay = 0.1
        while not stopping():
            try:
                await ensure_dead_letter_stream(self.nc, self.stream)
                await jetstream(self.nc).publish(subject, m.data or b"", headers=h)
            except (NatsError, TimeoutError) as exc:
                log.warning("global-order reader: setting aside a late record failed: %s", exc)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
                continue
            log.error("global-order reader: %s: set aside on %s", reason, subject)
            return True
        return False


__all__ = ["DeadLetters", "ensure_dead_letter_stream"]
