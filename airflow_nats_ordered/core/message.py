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


Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Any]
#: ``applied_position(partition) -> (seq, msg_id) | None``, sync or async
AppliedPosition = Callable[[int], Any]
