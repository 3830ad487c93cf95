"""``OrderedPublisher.publish_many`` (issue 33, goal 2's bulk entry) is a loop of
``publish()``: the same input stores the same messages (subjects, header blocks with the
same msg-ids and positions, payloads, stream order per partition), whether a record takes
the one-pass path (a key seen before, room in the bounds) or ``publish()``'s own (a new
key, keyless, bytes keys, a full pending bound); a bad record raises there, after the
records before it were queued. One shared server, a few thousand records: quick.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from airflow_nats_ordered.core.errors import KeylessRecordError
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

# repeated str keys (the one-pass path), keyless, bytes and base64-form keys (publish())
RECORDS: list[tuple[str | bytes | None, Any]] = [
    ([f"key-{i % 41}", f"key-{i % 7}", b"bytes-key", None, " Zürich "][i % 5], b"%d:" % i * 3)
    for i in range(3_000)
]
# payloads that are buffers but not bytes take the general path, with the same bytes
RECORDS[100:110] = [(k, bytearray(d)) for k, d in RECORDS[100:110]]
RECORDS[200:210] = [(k, memoryview(d)) for k, d in RECORDS[200:210]]


async def _stored(nc, stream: str, n: int) -> list[tuple]:
    js = nc.jetstream()
    out = []
    for seq in range(1, n + 1):
        msg = await js.get_msg(stream, seq)
        out.append((msg.subject, msg.headers, msg.data))
    return out


async def _publish(url: str, stream: str, many: bool) -> tuple[list[tuple], int]:
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=4))
    # max_pending 64: the bound is full often, so publish_many hands records to publish()
    async with OrderedPublisher(
        nc, stream, producer_id="many", allow_keyless=True, max_pending=64
    ) as pub:
        if many:
            assert await pub.publish_many(RECORDS[:1_000]) == 1_000
            assert await pub.publish_many(iter(RECORDS[1_000:])) == 2_000
        else:
            for key, data in RECORDS:
                await pub.publish(key, data)
    assert pub.summary is not None and pub.summary.acked == len(RECORDS)
    # per partition, in order: the interleaving across partitions may differ
    stored = sorted(await _stored(nc, stream, len(RECORDS)), key=lambda m: m[0])
    await nc.close()
    return stored, pub.summary.refused


def test_publish_many_stores_exactly_what_a_loop_of_publish_stores(shared_nats_server, unique_name):
    one = asyncio.run(_publish(shared_nats_server.url, unique_name + "A", many=False))
    many = asyncio.run(_publish(shared_nats_server.url, unique_name + "B", many=True))
    assert [(s.rsplit(".", 1)[1], h, d) for s, h, d in one[0]] == [
        (s.rsplit(".", 1)[1], h, d) for s, h, d in many[0]
    ]
    assert one[1] == many[1] == 0


def test_a_bad_record_raises_after_the_records_before_it_were_queued(
    shared_nats_server, unique_name
):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        async with OrderedPublisher(nc, unique_name, producer_id="bad") as pub:
            records = [("k", b"1"), ("k", b"2"), (None, b"keyless"), ("k", b"4")]
            with pytest.raises(KeylessRecordError):
                await pub.publish_many(records)
            # the refused record took its place in the input: the next one is the 4th
            await pub.publish_many(records[3:])
        await nc.close()
        return pub

    pub = asyncio.run(go())
    assert pub.summary is not None
    assert (pub.summary.acked, pub.summary.refused, pub._index) == (3, 1, 4)
