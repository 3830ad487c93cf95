"""What a handler receives (:class:`Message`) and the handler signatures a worker accepts.

A handler is called with one :class:`Message` (``Handler``), or in batch mode with a list
of them in stream order (``BatchHandler``). A handler object may also offer
``applied_position`` (``AppliedPosition``): the sink's last applied position of a
partition, which the worker checks against the stream at every grant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the header carrying a message's id (JetStream's de-duplication id)
HDR_MSG_ID = "Nats-Msg-Id"


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler receives.

    ``key`` is the key the record was published with, byte-exact whichever header form
    carried it (:func:`~.keys.message_key`), and it hashes to ``partition`` (records that
    do not are never handed over); ``""`` for a keyless record."""

    key: str
    data: bytes
    headers: dict[str, str]
    partition: int
    stream_seq: int
    fencing_token: int
    subject: str

    @property
    def producer_seq(self) -> int | None:
        v = self.headers.get("Nats-Ordered-Seq")
        return int(v) if v and v.isdigit() else None


class MessageSlots:
    """A :class:`Message` under construction: the same slots (so the same memory layout),
    without the frozen dataclass's ``__setattr__``, so each field is set by a plain
    attribute store; setting ``__class__`` to :class:`Message` then makes it one (see
    :func:`new_message`). Only the worker's hot path builds these."""

    __slots__ = Message.__slots__


def new_message(
    key: str,
    data: bytes,
    headers: dict[str, str],
    partition: int,
    stream_seq: int,
    fencing_token: int,
    subject: str,
) -> Message:
    """``Message(key, data, headers, partition, stream_seq, fencing_token, subject)``, built
    for the worker's hot path: the frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, and even the slots' own setters cost a call each; this sets them
    on a :class:`MessageSlots` (plain attribute stores) and gives it Message's class (the
    layouts are the same: the assignment is checked by Python). The result is the same
    frozen, equal :class:`Message` (its ``type`` is Message)."""
    m: Any = _NEW(MessageSlots)
    m.key = key
    m.data = data
    m.headers = headers
    m.partition = partition
    m.stream_seq = stream_seq
    m.fencing_token = fencing_token
    m.subject = subject
    m.__class__ = Message
    return m


_NEW = object.__new__


Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Any]
#: ``applied_position(partition) -> (seq, msg_id) | None``, sync or async
AppliedPosition = Callable[[int], Any]
