"""The partition contract: which partition a key belongs to, and its subject.

``partition = mmh3.hash(key_utf8, seed=0, signed=False) % partitions``

Spark, the workers and any external checker rely on this exact function; it is recorded in
the stream metadata (``HASH_NAME``, ``HASH_SEED``) so nobody has to guess it.
"""

from __future__ import annotations

import mmh3

HASH_NAME = "murmur3_x86_32"
HASH_SEED = 0


def key_bytes(key: str | bytes) -> bytes:
    """The bytes a key is hashed as: UTF-8 for str, as-is for bytes."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8")
    raise TypeError(f"a partition key must be str or bytes, not {type(key).__name__}")


def partition_for(key: str | bytes, partitions: int) -> int:
    """The partition of ``key`` among ``partitions``: murmur3_32(utf8(key), seed 0) mod P."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return mmh3.hash(key_bytes(key), HASH_SEED, signed=False) % partitions


def partition_subject(prefix: str, partition: int) -> str:
    """The subject of one partition: ``<prefix>.p.<n>``."""
    return f"{prefix}.p.{partition}"


def partition_subjects(prefix: str, partitions: int) -> list[str]:
    """Every partition subject of a stream, in partition order: ``<prefix>.p.0`` ...
    ``<prefix>.p.<P-1>``. This exact list is a stream's subjects, so the server itself
    refuses a publish to any other subject (``.p.<P>``, ``.p.00``, ``.p.x``)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return [partition_subject(prefix, p) for p in range(partitions)]


def partition_wildcard(prefix: str) -> str:
    """A subject *filter* matching every partition subject: ``<prefix>.p.*``.

    For reads only (stream-info filters, subscriptions). It is not a stream's subjects: it
    also matches subjects that are not partitions (``.p.00``, ``.p.x``). Streams created
    before the explicit subject list may still have it as their subjects (see
    :func:`..streams.provision`, which narrows them)."""
    return f"{prefix}.p.*"


def partition_of_subject(prefix: str, subject: str, partitions: int | None = None) -> int:
    """Inverse of :func:`partition_subject`.

    Only the canonical spelling is a partition: ASCII decimal digits without leading zeros
    (``.p.0``, ``.p.12``; never ``.p.00``, ``.p.012``, ``.p.+1``), and with ``partitions``
    given, below it. Raises ValueError for any other subject."""
    head = f"{prefix}.p."
    tail = subject[len(head) :] if subject.startswith(head) else ""
    canonical = tail.isascii() and tail.isdigit() and (tail == "0" or tail[0] != "0")
    if not canonical:
        raise ValueError(f"subject {subject!r} is not a partition subject of prefix {prefix!r}")
    n = int(tail)
    if partitions is not None and n >= partitions:
        raise ValueError(
            f"subject {subject!r} names partition {n}, but the stream has partitions 0 to "
            f"{partitions - 1}"
        )
    return n


def is_partition_subject(prefix: str, subject: str, partitions: int) -> bool:
    """True when ``subject`` is exactly one of the ``partitions`` partition subjects."""
    try:
        partition_of_subject(prefix, subject, partitions)
    except ValueError:
        return False
    return True
