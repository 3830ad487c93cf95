"""The publisher's hot path (issue 19 item 1) stores exactly what nats-py's public publish
stores.

A window of records is written as one command of ready ``HPUB`` frames (built once per
record, with a msg-id digest that hashes producer and partition once per partition), and a
key seen before skips its checks and its hash (a bounded cache). None of it may change a
byte on the wire or a record's partition: the same records published through the fast path
and through the fallback (one ``Client.publish`` per frame) are stored identically. Every
message goes through ``wire.send_frames``, however ``wire.send`` is wrapped.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core.errors import InvalidKeyError
from airflow_nats_ordered.core.publish import publisher as publisher_mod
from airflow_nats_ordered.core.publish import wire
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for

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


async def _publish_and_read(url: str, stream: str, fast: bool) -> list[tuple]:
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=4))
    async with OrderedPublisher(nc, stream, producer_id="same-producer", allow_keyless=True) as pub:
        assert pub._fast is fast
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


def test_coalesced_windows_store_exactly_what_public_publish_stores(
    shared_nats_server, unique_name, monkeypatch
):
    coalesced = asyncio.run(_publish_and_read(shared_nats_server.url, unique_name, True))

    # a nats-py without the internals the fast path writes to: every frame is sent with
    # Client.publish and a decoded header dict
    monkeypatch.setattr(wire, "supports_fast_path", lambda nc: False)
    single = asyncio.run(_publish_and_read(shared_nats_server.url, unique_name + "_B", False))
    # stream order differs between partitions (they are sent concurrently): compare each
    # partition's sequence, which is what the publisher orders
    for p in "0123":
        mine = [m for m in coalesced if m[0] == p]
        theirs = [m for m in single if m[0] == p]
        assert mine == theirs, f"partition {p} differs"
    assert len(coalesced) == len(single) == len(RECORDS)


def test_every_message_is_written_by_send_frames_in_windows_whatever_wraps_send(
    shared_nats_server, unique_name, monkeypatch
):
    """The lane writes through one seam, wire.send_frames, a window per call, however the
    module's functions are wrapped (instrumentation, a test's faults): the old lane fell back
    to one wire.send per message when wire.send was not the module's own function."""
    calls = {"send": 0, "send_frames": 0}
    real_send, real_send_frames = wire.send, wire.send_frames

    async def traced_send(*args):
        calls["send"] += 1
        await real_send(*args)

    async def traced_send_frames(*args):
        calls["send_frames"] += 1
        await real_send_frames(*args)

    monkeypatch.setattr(wire, "send", traced_send)
    monkeypatch.setattr(wire, "send_frames", traced_send_frames)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(4_000):
                await pub.publish(f"k{i % 40}", b"%d" % i)
        await nc.close()
        return pub.summary

    summary = asyncio.run(go())
    assert summary.acked == sum(p.stored or 0 for p in summary.partitions) == 4_000
    assert calls["send"] == 0, calls
    # at least one open and one commit per partition; the 4,000 records in windows
    assert 8 < calls["send_frames"] < 4_000 // 4, calls


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


def test_the_incremental_msg_id_is_the_documented_digest():
    """msg_id_at (what publish() inlines) hashes the producer id once per publisher; the id
    must stay blake2b-120 of producer\\0index\\0key\\0payload (protocol section 6), whatever
    the fields hold."""
    import hashlib

    from airflow_nats_ordered.core.publish.msg_ids import _msg_id, msg_id_at, msg_id_base

    for producer in (b"bench", b"100%-run", "r\u00e9".encode(), b"x" * 300):
        base = msg_id_base(producer)
        for index, key, data in (
            (1, b"k", b""),
            (12345678901, "Z\u00fcrich".encode(), b"\x00\r\n" * 40),
            (42, b"", b"y" * 70_000),
        ):
            want = hashlib.blake2b(
                b"%s\x00%d\x00%s\x00%s" % (producer, index, key, data), digest_size=15
            ).hexdigest()
            assert msg_id_at(base, index, key, data).decode() == want
            assert _msg_id(producer, index, key, data).decode() == want
