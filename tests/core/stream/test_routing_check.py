"""The record-routing check on plain values: which records a worker refuses to hand over."""

from __future__ import annotations

import pytest

from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.stream.routing_check import route_key


def _key_on(partition: int, partitions: int) -> str:
    return next(
        k for k in (f"key-{i}" for i in range(1000)) if partition_for(k, partitions) == partition
    )


def test_a_key_on_its_own_partition_passes():
    k = _key_on(2, 4)
    assert route_key({"Nats-Ordered-Key": k}, 2, 4) == (k, None)


def test_a_key_on_another_partition_is_misrouted_and_says_where_it_belongs():
    k = _key_on(2, 4)
    key, why = route_key({"Nats-Ordered-Key": k}, 3, 4)
    assert key == k
    assert why.startswith(f"misrouted: key {k!r} hashes to partition 2, found on partition 3")


def test_a_very_long_key_is_quoted_shortly():
    k = "x" * 5000
    home = partition_for(k, 8)
    _, why = route_key({"Nats-Ordered-Key": k}, (home + 1) % 8, 8)
    assert "(5000 characters)" in why and len(why) < 600


@pytest.mark.parametrize("headers", [None, {}, {"Other": "x"}])
def test_a_keyless_record_passes_unless_the_stream_requires_keys(headers):
    assert route_key(headers, 0, 4) == (None, None)
    key, why = route_key(headers, 0, 4, keys_required=True)
    assert key is None and why.startswith("keyless: the record has no key")


def test_an_undecodable_key_header_is_a_malformed_key():
    def decode(headers):
        raise ValueError("bad base64 in key header")

    key, why = route_key({"Nats-Ordered-Key": "b64:%%%"}, 0, 4, decode=decode)
    assert key is None
    assert why == "malformed key: the key header cannot be decoded (bad base64 in key header)"


def test_an_encoded_key_is_checked_byte_exact():
    import base64

    from airflow_nats_ordered.core.stream.keys import HDR_KEY_B64

    k = next(k for k in (f" lead-{i}\u3000" for i in range(1000)) if partition_for(k, 8) == 5)
    assert partition_for(k.strip(), 8) != 5  # the trimmed key would be misrouted
    encoded = {HDR_KEY_B64: base64.b64encode(k.encode()).decode()}
    assert route_key(encoded, 5, 8) == (k, None)


def test_both_key_headers_or_bad_base64_are_a_malformed_key_with_the_real_decoder():
    key, why = route_key({"Nats-Ordered-Key": "a", "Nats-Ordered-Key-B64": "YQ=="}, 0, 4)
    assert key is None and why.startswith("malformed key:") and "both" in why
    _, why = route_key({"Nats-Ordered-Key-B64": "%%%"}, 0, 4)
    assert why.startswith("malformed key:") and "not valid base64" in why
