"""What a handler receives (:class:`Message`) and the handler signatures a worker accepts.

A handler is called with one :class:`Message` (``Handler``), or in batch mode with a list
of them in stream order (``BatchHandler``). A handler object may also offer
``applied_position`` (``AppliedPosition``): the sink's last applied position of a
partition, which the worker checks against the stream at every grant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
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


def _setters() -> tuple[Callable[[Message, Any], None], ...]:
    """The slot setters of Message's fields, in the order they are declared."""
    return tuple(Message.__dict__[f.name].__set__ for f in fields(Message))


_NEW = object.__new__
_SET_KEY, _SET_DATA, _SET_HEADERS, _SET_PARTITION, _SET_SEQ, _SET_TOKEN, _SET_SUBJECT = _setters()


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
    ``object.__setattr__`` (about half of what building the handler's view of a delivery
    cost); this sets the slots directly. The result is the same frozen, equal, hashable
    :class:`Message`."""
    m = _NEW(Message)
    _SET_KEY(m, key)
    _SET_DATA(m, data)
    _SET_HEADERS(m, headers)
    _SET_PARTITION(m, partition)
    _SET_SEQ(m, stream_seq)
    _SET_TOKEN(m, fencing_token)
    _SET_SUBJECT(m, subject)
    return m


Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Any]
#: ``applied_position(partition) -> (seq, msg_id) | None``, sync or async
AppliedPosition = Callable[[int], Any]
