"""Dead letters: where a worker puts a message it must not hand over or keeps failing on.

Guarantees: with the poison policy ``dead-letter``, a message goes to
``<prefix>.dlq.<group>.<partition>`` (:func:`dead_letter_subject`, in the stream
``<STREAM>_DLQ``) with its headers, plus why (``Nats-Ordered-Error``) and where it came
from (``Nats-Ordered-Origin``: stream, group, partition, sequence, token); processing
moves on only once the server stored it. Never a silent skip: while publishing fails it is
retried with capped backoff and reported in the member's problems, the partition held (its
lease renewed, nothing after the message processed). :class:`DeadLetters` publishes them
for a member's delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.leases import LeaseLost
from airflow_nats_ordered.core.stream.message import Message
from airflow_nats_ordered.core.worker.config import BACKOFF_MAX
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.owned import OwnedPartition

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

HDR_ERROR = "Nats-Ordered-Error"
HDR_ORIGIN = "Nats-Ordered-Origin"


def dead_letter_subject(prefix: str, group: str, partition: int) -> str:
    return f"{prefix}.dlq.{group}.{partition}"


class DeadLetters:
    """A member's dead letters (see the module), for :class:`~.delivery.Delivery`."""

    def __init__(self, ctx: MemberContext) -> None:
        #: read here: the connection, settings, stream and member id; written: statistics
        #: (``dead_lettered``) and problems
        self.ctx = ctx

    async def ensure_stream(self) -> None:
        """Create ``<STREAM>_DLQ`` unless it exists; NatsOrderedError saying why if it cannot
        be created."""
        stream = self.ctx.stream
        js = jetstream(self.ctx.nc)
        name = f"{stream.name}_DLQ"
        subjects = f"{stream.prefix}.dlq.>"
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            pass
        try:
            await js.add_stream(
                name=name,
                subjects=[subjects],
                storage=api.StorageType.FILE,
                num_replicas=stream.replicas,
                duplicate_window=stream.duplicate_window or 120,
            )
        except NatsError as exc:
            with contextlib.suppress(NotFoundError):
                await js.stream_info(name)
                return  # created concurrently by another member
            raise NatsOrderedError(
                f"the dead-letter stream {name} could not be created ({exc}); create it with "
                f"subjects {subjects!r}, or use poison='block'"
            ) from exc

    async def publish(self, o: OwnedPartition, m: Message, reason: str) -> bool:
        """Publish ``m`` to its dead-letter subject, retrying with capped exponential
        backoff while the partition is held (its lease renewed, nothing after ``m``
        processed) and reporting the failure in the member's problems. False if the partition
        was revoked meanwhile (the next owner handles ``m`` again)."""
        ctx, cfg, stream = self.ctx, self.ctx.cfg, self.ctx.stream
        headers = dict(m.headers)
        headers[HDR_ERROR] = reason.replace("\r", " ").replace("\n", " ")[:1000]
        headers[HDR_ORIGIN] = json.dumps(
            {
                "stream": stream.name,
                "group": cfg.group,
                "partition": m.partition,
                "seq": m.stream_seq,
                "token": m.fencing_token,
            }
        )
        if "Nats-Msg-Id" in headers:
            headers["Nats-Msg-Id"] = f"{cfg.group}:{headers['Nats-Msg-Id']}"
        subject = dead_letter_subject(stream.prefix, cfg.group, m.partition)
        key = f"dead-letter.{m.partition}"
        delay = 0.0
        while True:
            try:
                await jetstream(ctx.nc).publish(subject, m.data, headers=headers)
                break
            except (NatsError, TimeoutError) as exc:
                cause: Exception = exc
                with contextlib.suppress(NatsError, TimeoutError):
                    try:
                        await self.ensure_stream()  # deleted meanwhile?
                    except NatsOrderedError as why:
                        cause = why
            delay = min(BACKOFF_MAX, max(cfg.tick, cfg.retry_backoff, delay * 2))
            ctx.report(
                key,
                f"partition {m.partition}: dead-lettering seq {m.stream_seq} failed: {cause}; "
                f"retrying in {delay:.1f}s",
            )
            await asyncio.sleep(delay)
            if not o.lease.valid:
                raise LeaseLost(f"lease of partition {o.partition} expired")
            if o.revoke.is_set():
                return False
        ctx.report(key, None)
        ctx.report("dead-letter", None)
        ctx.stats["dead_lettered"] += 1
        log.error(
            "member %s: partition %d seq %d dead-lettered after retries: %s",
            ctx.member,
            m.partition,
            m.stream_seq,
            reason,
        )
        return True
