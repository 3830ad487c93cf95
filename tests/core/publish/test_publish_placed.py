"""``OrderedPublisher.publish_placed`` (the Spark sink's routed rows at their ranks,
issue 33 goal 3) is a loop of ``publish(key, data, index=place)``: on a real server the
same input stores the same messages (subjects, header blocks with the same msg-ids and
positions, payloads), passes over the same records on resume, refuses the same records
for the same reasons, and hands back per record taken its partition and the msg-id the
general path derived, whether a record takes the one-pass path or ``publish()``'s own (a
new key, keyless, bytes keys, a buffer payload, a full pending bound, a lane resuming, a
record too large or with a bad key). One shared server, a few thousand records: quick.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from airflow_nats_ordered.core.errors import KeylessRecordError, RecordError
from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

_KEYS: list[Any] = ["key-%d", "key-%d", b"bytes-key", None, " Zürich ", b"\xff\xfe", "k"]
RECORDS: list[tuple[Any, Any]] = [
    (k % (i % 41) if isinstance(k, str) and "%" in k else k, b"%d:" % i * 3)
    for i, k in ((i, _KEYS[i % 7]) for i in range(3_000))
]
RECORDS[100:110] = [(k, bytearray(d)) for k, d in RECORDS[100:110]]
RECORDS[300] = ("key-3", b"x" * 5_000)  # too large for the stream's max_msg_size
RECORDS[301] = ("key-3", b"y" * 3_900)  # too large only with its headers
# places as the sink's ranks: repeated, not increasing, not the call count
PLACES = [(i % 13) + 1 + (i // 97) for i in range(len(RECORDS))]
START_AFTER = {0: 7, 2: 3}  # an earlier attempt stored these positions: passed over


def _kb(key: Any) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key or b"")


async def _run(url: str, stream: str, placed: bool) -> dict[str, Any]:
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=4, max_msg_size=4_096))
    ids: list[bytes] = []
    parts: list[int] = []
    refused: list[tuple[int, type]] = []
    async with OrderedPublisher(
        nc,
        stream,
        producer_id="placed",
        allow_keyless=True,
        max_pending=64,
        start_after=START_AFTER,
    ) as pub:
        if placed:
            keys = [k for k, _ in RECORDS]
            payloads = [d for _, d in RECORDS]
            half = 1_500
            for lo, hi in ((0, half), (half, len(RECORDS))):

                def note(i: int, e: RecordError, lo: int = lo) -> None:
                    refused.append((lo + i, type(e)))

                await pub.publish_placed(
                    keys[lo:hi],
                    payloads[lo:hi],
                    PLACES[lo:hi],
                    ids=ids,
                    parts=parts,
                    refused=note,
                )
        else:
            for i, ((key, data), place) in enumerate(zip(RECORDS, PLACES, strict=True)):
                try:
                    parts.append(await pub.publish(key, data, index=place))
                except RecordError as exc:
                    refused.append((i, type(exc)))
                    continue
                ids.append(derive_msg_id("placed", place, _kb(key), bytes(data)).encode())
    s = pub.summary
    assert s is not None
    js = nc.jetstream()
    info = await js.stream_info(stream)
    stored = []
    for seq in range(1, info.state.messages + 1):
        msg = await js.get_msg(stream, seq)
        stored.append((str(msg.subject).rsplit(".", 1)[1], msg.headers, msg.data))
    await nc.close()
    return {
        "stored": sorted(stored, key=lambda m: m[0]),  # per partition, in order
        "ids": ids,
        "parts": parts,
        "refused": refused,
        "counts": [(p.offset, p.accepted, p.acked, p.failed) for p in s.partitions],
        "refused_n": s.refused,
        "index": pub._index,
    }


def test_publish_placed_stores_and_hands_back_what_publish_with_index_does(
    shared_nats_server, unique_name
):
    one = asyncio.run(_run(shared_nats_server.url, unique_name + "A", placed=False))
    many = asyncio.run(_run(shared_nats_server.url, unique_name + "B", placed=True))
    assert one["stored"] == many["stored"]
    assert one["ids"] == many["ids"] and one["parts"] == many["parts"]
    assert one["refused"] == many["refused"]
    assert {t.__name__ for _, t in one["refused"]} == {"InvalidKeyError", "RecordTooLargeError"}
    assert one["counts"] == many["counts"] and one["refused_n"] == many["refused_n"]
    assert one["index"] == many["index"]
    # the ids handed back are the stored ones (passed-over records are not stored again)
    stored_ids = {h["Nats-Msg-Id"] for _, h, _ in many["stored"]}
    assert stored_ids <= {m.decode() for m in many["ids"]}
    assert len(many["ids"]) - len(stored_ids) == sum(START_AFTER.values())


def test_without_refused_a_bad_record_raises_after_the_records_before_it(
    shared_nats_server, unique_name
):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        ids: list[bytes] = []
        parts: list[int] = []
        async with OrderedPublisher(nc, unique_name, producer_id="bad") as pub:
            await pub.publish("k", b"0", index=9)  # the key is known: the one-pass path
            with pytest.raises(KeylessRecordError):
                await pub.publish_placed(
                    ["k", "k", None, "k"],
                    [b"1", b"2", b"3", b"4"],
                    [5, 6, 7, 8],
                    ids=ids,
                    parts=parts,
                )
        await nc.close()
        return pub, ids, parts

    pub, ids, parts = asyncio.run(go())
    assert pub.summary is not None and (pub.summary.acked, pub.summary.refused) == (3, 1)
    assert ids == [derive_msg_id("bad", i, b"k", b"%d" % (i - 4)).encode() for i in (5, 6)]
    assert len(parts) == 2 and pub._index == 7
