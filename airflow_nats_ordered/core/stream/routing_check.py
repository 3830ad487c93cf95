"""Does a record belong to the partition it was read from? (pure, no I/O)

Every record a worker reads is checked before its handler sees it: its key (decoded from
its headers by :func:`~.keys.message_key`) must hash to the partition whose subject it was
stored on (``partition_for(key, P) == p``). A record that fails the check was published by
a client that routed it differently (another hash, another partition count, a hand-written
subject): handing it over would apply it out of order with the other records of its key,
which live on another partition. It is rejected instead and follows the poison policy
(dead-lettered with the reason, or the partition blocks), without a handler call:

* ``misrouted``: its key hashes to another partition;
* ``keyless``: it has no key but the stream requires keys;
* ``malformed key``: its key header cannot be decoded (``Nats-Ordered-Key-B64`` not
  canonical base64 of UTF-8, or both key headers set: :class:`~..errors.KeyEncodingError`).

The key is compared byte-exact, whichever header form carried it: a key with blanks,
non-ASCII or control characters travels base64-encoded and hashes as published.

Cost: one header lookup and one murmur3 hash of the key per record (well under a
microsecond for keys of ordinary length).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.partitioning import partition_for

#: how much of a key a rejection reason quotes
_QUOTE = 200


def _quote(key: str) -> str:
    text = repr(key)
    return text if len(text) <= _QUOTE else f"{text[:_QUOTE]}...' ({len(key)} characters)"


def route_key(
    headers: Mapping[str, str] | None,
    partition: int,
    partitions: int,
    *,
    keys_required: bool = False,
    decode: Callable[[Mapping[str, str] | None], str | None] = message_key,
) -> tuple[str | None, str | None]:
    """``(key, rejection)`` of a record read from ``partition`` of a ``partitions``-partition
    stream: its key (None for a keyless or undecodable record) and, if it must not be
    handed to the handler, why (one line, starting with ``misrouted``, ``keyless`` or
    ``malformed key``); ``rejection`` is None for a record that belongs where it is."""
    try:
        key = decode(headers)
    except Exception as exc:  # KeyEncodingError, or whatever a malformed header raises
        return None, f"malformed key: the key header cannot be decoded ({exc})"
    if key is None:
        if keys_required:
            return None, (
                "keyless: the record has no key (neither Nats-Ordered-Key nor "
                "Nats-Ordered-Key-B64) but the stream "
                "requires one; publish it with a key"
            )
        return None, None
    home = partition_for(key, partitions)
    if home != partition:
        return key, (
            f"misrouted: key {_quote(key)} hashes to partition {home}, found on partition "
            f"{partition}; it was published on the wrong subject (publish to the subject of "
            f"partition murmur3_32(utf8(key)) mod {partitions})"
        )
    return key, None
