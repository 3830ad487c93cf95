"""The derived ``Nats-Msg-Id`` and the headers the publisher sets on every record.

A record's msg-id is derived from the producer id, the record's place in the run's input
(its 1-based index in input order), its key and its payload: the same input in the same
order gives the same ids on every retry or rerun, whatever the stream's partition count,
which is what lets the server de-duplicate resends and reruns, also across a
``repartition``. Nothing of the layout (partition, position in the partition) is in it. The
derivation is part of the wire protocol (``docs/protocol.md``, section 6, checked by its
golden vectors); the header block is section 5.3.
"""

from __future__ import annotations

import hashlib
from binascii import hexlify
from typing import Any

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.keys import HDR_KEY, HDR_KEY_B64

HDR_MSG_ID = "Nats-Msg-Id"
HDR_SEQ = "Nats-Ordered-Seq"
HDR_PRODUCER = "Nats-Ordered-Producer"
RESERVED_HEADERS = frozenset(
    h.lower() for h in (HDR_MSG_ID, HDR_KEY, HDR_KEY_B64, HDR_SEQ, HDR_PRODUCER)
)


def _check_header_value(what: str, value: str) -> None:
    if "\r" in value or "\n" in value:
        raise ConfigError(f"{what} must not contain line breaks: {value!r}")


def derive_msg_id(producer_id: str | bytes, index: int, key: str | bytes, data: bytes) -> str:
    """The default ``Nats-Msg-Id``: a digest of the producer id, the record's place in the
    run's input (``index``, 1-based), its key and its payload. The same input in the same
    order gives the same ids on every retry or rerun, on any layout of the stream (the
    partition is not in it); identical records at different places get different ids; a
    different ``producer_id`` gives different ids."""
    pb = producer_id.encode() if isinstance(producer_id, str) else producer_id
    kb = key.encode() if isinstance(key, str) else key
    return _msg_id(pb, index, kb, data).decode()


def _msg_id(producer: bytes, index: int, key: bytes, data: bytes) -> bytes:
    """The one definition of the derived msg-id (see :func:`derive_msg_id`)."""
    return msg_id_at(msg_id_base(producer), index, key, data)


def msg_id_base(producer: bytes) -> Any:
    """The msg-id digest of a producer's records before their own fields: the producer id,
    hashed once. :func:`msg_id_at` of it is a record's msg-id."""
    return hashlib.blake2b(b"%s\x00" % producer, digest_size=15)


def msg_id_at(base: Any, index: int, key: bytes, data: bytes) -> bytes:
    """The derived msg-id of the record at place ``index`` of the input (``base`` from
    :func:`msg_id_base`): blake2b-120 of ``producer\\0index\\0key\\0payload``, in hex. The
    publisher inlines these lines on its hot path (issue 19 item 1)."""
    h = base.copy()
    h.update(b"%d\x00%s\x00" % (index, key))
    h.update(data)
    return hexlify(h.digest())


__all__ = [
    "HDR_MSG_ID",
    "HDR_PRODUCER",
    "HDR_SEQ",
    "RESERVED_HEADERS",
    "derive_msg_id",
    "msg_id_at",
    "msg_id_base",
]
