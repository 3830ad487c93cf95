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


def partition_wildcard(prefix: str) -> str:
    """The subject filter covering every partition of a stream: ``<prefix>.p.*``."""
    return f"{prefix}.p.*"


def partition_of_subject(prefix: str, subject: str) -> int:
    """Inverse of :func:`partition_subject`; raises ValueError for a foreign subject."""
    head = f"{prefix}.p."
    if not subject.startswith(head) or not subject[len(head) :].isdigit():
        raise ValueError(f"subject {subject!r} is not a partition subject of prefix {prefix!r}")
    return int(subject[len(head) :])
