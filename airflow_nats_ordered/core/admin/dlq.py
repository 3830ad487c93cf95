"""The dead-letter stream of a partitioned stream: its name, its subject prefix, and how
many dead letters a group has in it.

A group's dead letters live in the stream ``<STREAM>_DLQ`` on the subjects
``<prefix>.dlq.<group>.<partition>`` (written by :mod:`..worker.dead_letters`); that stream
is shared by every group of the stream. Reading, replaying and purging them is
:mod:`.dead_letters`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream

#: Suffix of the dead-letter stream of a partitioned stream: ``ORDERS`` -> ``ORDERS_DLQ``.
DEAD_LETTER_SUFFIX = "_DLQ"


def dead_letter_stream(stream: str) -> str:
    """The name of the stream holding the dead letters of every group of ``stream``."""
    return f"{stream}{DEAD_LETTER_SUFFIX}"


@dataclass(frozen=True)
class DeadLetters:
    """Where a group's dead letters are and how many there are (0 if the stream is absent)."""

    stream: str
    subjects: str
    messages: int
    exists: bool


async def dead_letter_prefix(nc: NATS, stream: str) -> str | None:
    """The subject prefix of ``stream``'s dead-letter stream (from its ``<prefix>.dlq.>``
    subject, so it is known even when the partitioned stream is gone); None if absent."""
    try:
        info = await jetstream(nc).stream_info(dead_letter_stream(stream))
    except NotFoundError:
        return None
    for subject in info.config.subjects or []:
        if subject.endswith(".dlq.>"):
            return subject[: -len(".dlq.>")]
    return None


async def dead_letters(nc: NATS, stream: str, group: str) -> DeadLetters:
    """Count ``group``'s dead letters in ``<stream>_DLQ``."""
    name = dead_letter_stream(stream)
    prefix = await dead_letter_prefix(nc, stream)
    if prefix is None:
        return DeadLetters(name, f"<prefix>.dlq.{group}.*", 0, exists=False)
    subjects = f"{prefix}.dlq.{group}.*"
    info = await jetstream(nc).stream_info(name, subjects_filter=subjects)
    return DeadLetters(name, subjects, sum((info.state.subjects or {}).values()), exists=True)
