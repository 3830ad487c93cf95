"""Setting a late record aside (the time-window mode's ``late="dead-letter"``,
:func:`set_aside`), with the conventions of a worker's dead letters
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
from typing import Any

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR, HDR_ORIGIN, dead_letter_subject

log = logging.getLogger(__name__)


async def ensure_dead_letter_stream(reader: Any) -> None:
    js = reader.nc.jetstream()
    stream = reader.stream
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


async def set_aside(reader: Any, p: int, item: Any, reason: str) -> bool:
    """Publish the late record ``item`` of partition ``p`` of ``reader`` (a
    :class:`~.reader.GlobalOrderReader`) to its dead-letter subject."""
    seq, m, headers, _ = item
    cfg = reader.group_config
    h = dict(headers)
    h[HDR_ERROR] = reason
    h[HDR_ORIGIN] = json.dumps(
        {
            "stream": cfg.stream,
            "group": cfg.group,
            "partition": p,
            "seq": seq,
            "token": reader._token,
        }
    )
    if "Nats-Msg-Id" in h:
        h["Nats-Msg-Id"] = f"{cfg.group}:{h['Nats-Msg-Id']}"
    subject = dead_letter_subject(reader.stream.prefix, cfg.group, p)
    delay = 0.1
    while not reader._stopping:
        try:
            await ensure_dead_letter_stream(reader)
            await reader.nc.jetstream().publish(subject, m.data or b"", headers=h)
        except (NatsError, TimeoutError) as exc:
            log.warning("global-order reader: setting aside a late record failed: %s", exc)
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)
            continue
        log.error("global-order reader: %s: set aside on %s", reason, subject)
        return True
    return False


__all__ = ["ensure_dead_letter_stream", "set_aside"]
