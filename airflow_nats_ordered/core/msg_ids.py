"""The derived ``Nats-Msg-Id`` and the headers the publisher sets on every record.

A record's msg-id is derived from the producer id, its position in its partition (producer
sequence), its key and its payload: the same input in the same order gives the same ids on
every retry or rerun, which is what lets the server de-duplicate resends and reruns. The
derivation is part of the wire protocol (``docs/protocol.md``, section 6, checked by its
golden vectors); the header block is section 5.3. :mod:`.publisher` re-exports every name.
"""

from __future__ import annotations

import hashlib

from .errors import ConfigError
from .keys import HDR_KEY, HDR_KEY_B64

HDR_MSG_ID = "Nats-Msg-Id"
HDR_SEQ = "Nats-Ordered-Seq"
HDR_PRODUCER = "Nats-Ordered-Producer"
RESERVED_HEADERS = frozenset(
    h.lower() for h in (HDR_MSG_ID, HDR_KEY, HDR_KEY_B64, HDR_SEQ, HDR_PRODUCER)
)


def _check_header_value(what: str, value: str) -> None:
    if "\r" in value or "\n" in value:
        raise ConfigError(f"{what} must not contain line breaks: {value!r}")


def derive_msg_id(
    producer_id: str | bytes, partition: int, seq: int, key: str | bytes, data: bytes
) -> str:
    """The default ``Nats-Msg-Id``: a digest of the producer id, the record's position in its
    partition (its producer sequence), its key and its payload. The same input in the same
    order gives the same ids on every retry or rerun; identical records at different
    positions get different ids; a different ``producer_id`` gives different ids."""
    pb = producer_id.encode() if isinstance(producer_id, str) else producer_id
    kb = key.encode() if isinstance(key, str) else key
    return _msg_id(pb, partition, seq, kb, data).decode()


def _msg_id(producer: bytes, partition: int, seq: int, key: bytes, data: bytes) -> bytes:
    """The one definition of the derived msg-id (see :func:`derive_msg_id`)."""
    digest = hashlib.blake2b(
        b"%s\x00%d\x00%d\x00%s\x00%s" % (producer, partition, seq, key, data), digest_size=15
    )
    return digest.hexdigest().encode()


__all__ = [
    "HDR_MSG_ID",
    "HDR_PRODUCER",
    "HDR_SEQ",
    "RESERVED_HEADERS",
    "derive_msg_id",
]
