"""The publisher's hot path (issue 19 item 1) sends exactly what the one-at-a-time path sent.

A window of records is written as one command of ``HPUB`` frames, and a key seen before
skips its checks and its hash (a bounded cache). Neither may change a byte on the wire or a
record's partition: the same records published both ways are stored identically.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core import publisher as publisher_mod
from airflow_nats_ordered.core import wire
from airflow_nats_ordered.core.errors import InvalidKeyError
from airflow_nats_ordered.core.partitioning import partition_for
from airflow_nats_ordered.core.publisher import OrderedPublisher
from airflow_nats_ordered.core.streams import StreamSpec, provision

# repeated plain keys, a key that needs the encoded (base64) header form, a bytes key,
# keyless records (round-robin) and caller headers
RECORDS: list[tuple[str | bytes | None, bytes, dict[str, str] | None]] = [
    (
        [f"key-{i % 37}", " Zürich ", b"bytes-key", None][i % 4],
        b"%d:" % i + b"x" * (i % 50),
        {"X-Trace": f"t{i}"} if i % 5 == 0 else None,
    )
    for i in range(600)
]


async def _publish_and_read(url: str, stream: str, coalesce: bool) -> list[tuple]:
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=4))
    async with OrderedPublisher(nc, stream, producer_id="same-producer", allow_keyless=True) as pub:
        assert wire.can_coalesce(pub._fast) is coalesce
        for key, data, headers in RECORDS:
            await pub.publish(key, data, headers=headers)
    assert pub.summary is not None and pub.summary.acked == len(RECORDS)
    js = nc.jetstream()
    out = []
    for seq in range(1, len(RECORDS) + 1):
        msg = await js.get_msg(stream, seq)
        out.append((msg.subject.rsplit(".", 1)[1], msg.headers, msg.data))
    await nc.close()
    return out


def test_coalesced_windows_store_exactly_what_single_sends_store(
    shared_nats_server, unique_name, monkeypatch
):
    coalesced = asyncio.run(_publish_and_read(shared_nats_server.url, unique_name, True))

    real_send = wire.send

    async def one_at_a_time(*args):  # a wrapper in send's place: one message per call
        await real_send(*args)

    monkeypatch.setattr(wire, "send", one_at_a_time)
    single = asyncio.run(_publish_and_read(shared_nats_server.url, unique_name + "_B", False))
    # stream order differs between partitions (they are sent concurrently): compare each
    # partition's sequence, which is what the publisher orders
    for p in "0123":
        mine = [m for m in coalesced if m[0] == p]
        theirs = [m for m in single if m[0] == p]
        assert mine == theirs, f"partition {p} differs"
    assert len(coalesced) == len(single) == len(RECORDS)


def test_the_key_cache_keeps_partitions_and_refusals_and_stays_bounded(
    shared_nats_server, unique_name, monkeypatch
):
    monkeypatch.setattr(publisher_mod, "_KEY_CACHE_SIZE", 50)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=8))
        async with OrderedPublisher(nc, unique_name) as pub:
            for rnd in range(3):  # the second and third time every key is a cached one
                for i in range(120):
                    key = f"k{i}"
                    assert await pub.publish(key, b"r%d" % rnd) == partition_for(key, 8)
                    assert len(pub._keys) <= 50
            long_key = "L" * 300  # past the cache's per-key limit: never cached
            assert await pub.publish(long_key, b"x") == partition_for(long_key, 8)
            assert long_key not in pub._keys
            for _ in range(2):  # a refused key is refused every time, never cached
                with pytest.raises(InvalidKeyError):
                    await pub.publish("\ud800", b"x")
            assert "\ud800" not in pub._keys
        await nc.close()
        return pub.summary

    summary = asyncio.run(go())
    assert summary.acked == 3 * 120 + 1 and summary.refused == 2
