"""The partition contract: murmur3_x86_32(utf8(key), seed 0) unsigned, mod P."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_nats_ordered.core.stream.partitioning import (
    HASH_NAME,
    HASH_SEED,
    partition_for,
    partition_of_subject,
    partition_subject,
    partition_wildcard,
)

# Published MurmurHash3_x86_32 test vectors (seed 0): the function must be the standard one,
# not Spark's hash() nor Python's hash(), or external checkers would disagree with us.
VECTORS = {
    "": 0x00000000,
    "hello": 0x248BFA47,
    "The quick brown fox jumps over the lazy dog": 0x2E4FF723,
}


@pytest.mark.parametrize("key,h", VECTORS.items())
def test_partition_function_is_standard_murmur3_x86_32(key: str, h: int) -> None:
    for p in (1, 7, 16, 4096):
        assert partition_for(key, p) == h % p
    assert HASH_NAME == "murmur3_x86_32" and HASH_SEED == 0


def test_keys_hash_as_utf8_bytes() -> None:
    assert partition_for("é", 97) == partition_for("é".encode(), 97)
    assert partition_for("N14228", 16) == partition_for(b"N14228", 16)


@given(st.text(), st.integers(min_value=1, max_value=5000))
def test_partition_is_in_range_and_stable(key: str, p: int) -> None:
    part = partition_for(key, p)
    assert 0 <= part < p
    assert partition_for(key, p) == part


def test_partitions_spread_keys_evenly() -> None:
    counts = [0] * 16
    for i in range(16_000):
        counts[partition_for(f"key-{i}", 16)] += 1
    assert min(counts) > 800 and max(counts) < 1200


def test_bad_partition_count_and_key_type_are_refused() -> None:
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        partition_for("k", 0)
    with pytest.raises(TypeError, match="str or bytes"):
        partition_for(42, 3)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=10_000))
def test_subject_round_trip(n: int) -> None:
    assert partition_of_subject("orders.eu", partition_subject("orders.eu", n)) == n


def test_foreign_subjects_are_rejected() -> None:
    assert partition_wildcard("orders") == "orders.p.*"
    for subject in ("orders.x.1", "other.p.1", "orders.p.", "orders.p.1a"):
        with pytest.raises(ValueError):
            partition_of_subject("orders", subject)
