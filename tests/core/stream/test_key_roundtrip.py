"""A key reaches the handler exactly as it was published (issue 13 item 4): keys with
leading or trailing blanks, Unicode blanks, control characters, CR/LF, non-ASCII text and
the longest allowed key travel through the real publisher, server and worker byte-exact, on
the partition their exact UTF-8 bytes hash to, in order, and none is rejected as misrouted.
Keys that cannot be keys (too long, not UTF-8) are refused at publish, naming the key."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import nats
import pytest

from airflow_nats_ordered.core.errors import InvalidKeyError
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.keys import HDR_KEY, HDR_KEY_B64, MAX_KEY_BYTES
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

P = 8
N = 3  # records per key
UNSAFE = [
    " lead",
    "trail ",
    "\u00a0nbsp",
    "ideo\u3000",
    "a\r\nb",
    "tab\there",
    "nul\x00",
    "Zürich",
    "🙂",
    "é" * (MAX_KEY_BYTES // 2),  # the longest key, non-ASCII: 4096 bytes in UTF-8
]
SAFE = ["plain-key", "L" * MAX_KEY_BYTES]  # the longest plain key: 4096 bytes


async def _until(cond, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_every_key_reaches_the_handler_byte_exact_on_its_partition_in_order(nats_url, unique_name):
    keys = UNSAFE + SAFE
    seen: list[tuple[str, int, int]] = []  # (key, i, partition)

    def handler(msg):
        seen.append((msg.key, json.loads(msg.data)["i"], msg.partition))

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=P))
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(N):
                for k in keys:
                    assert await pub.publish(k, json.dumps({"i": i}).encode()) == (
                        partition_for(k, P)
                    )
        # what another client sees on the wire: a raw nats-py JetStream subscriber
        sub = await nc.jetstream().pull_subscribe(">", stream=unique_name)
        raw = []
        while len(raw) < len(keys) * N:
            raw += await sub.fetch(len(keys) * N - len(raw), timeout=30)
        w = Worker(nc, WorkerConfig(unique_name, "g", member_id="m1", lease_ttl=2.0), handler)
        await w.start()
        # every record is handed over or dead-lettered (a misrouted or malformed key)
        await _until(lambda: len(seen) + w.stats["dead_lettered"] >= len(keys) * N)
        await asyncio.sleep(0.2)  # anything more would show up now
        await w.stop()
        await nc.close()
        return raw, w.stats

    raw, stats = asyncio.run(go())
    assert stats["dead_lettered"] == 0 and stats["rejected"] == 0, stats
    assert len(seen) == len(keys) * N, seen
    for k in keys:
        got = [(i, p) for key, i, p in seen if key == k]
        assert got == [(i, partition_for(k, P)) for i in range(N)], (k, got)
    for m in raw:
        names = {h for h in m.headers if h.startswith(HDR_KEY)}
        assert len(names) == 1, m.headers  # exactly one key header per record
    by_key: dict[str, set[str]] = {}
    for m in raw:
        if HDR_KEY_B64 in m.headers:
            by_key.setdefault(base64.b64decode(m.headers[HDR_KEY_B64]).decode(), set()).add(
                HDR_KEY_B64
            )
        else:
            by_key.setdefault(m.headers[HDR_KEY], set()).add(HDR_KEY)
    assert by_key == {**{k: {HDR_KEY_B64} for k in UNSAFE}, **{k: {HDR_KEY} for k in SAFE}}


@pytest.mark.parametrize(
    "key, quoted, why",
    [
        ("k" * (MAX_KEY_BYTES + 1), "key 'kkkk", "is 4097 bytes in UTF-8; at most 4096"),
        (b"caf\xe9", "key b'caf\\xe9'", "is not valid UTF-8"),
        ("lone\ud800", "key 'lone\\ud800'", "is not valid text"),
    ],
)
def test_a_key_that_cannot_be_a_key_is_refused_at_publish_naming_it(
    nats_url, unique_name, key, quoted, why
):
    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        async with OrderedPublisher(nc, unique_name) as pub:
            with pytest.raises(InvalidKeyError) as err:
                await pub.publish(key, b"{}")
            await pub.publish("after", b"{}")  # the publisher goes on
            summary = await pub.flush()
        await nc.close()
        return err.value, summary, pub.refused

    exc, summary, refused = asyncio.run(go())
    assert str(exc).startswith(quoted) and why in str(exc), str(exc)
    assert refused == 1 and summary.acked == 1  # nothing of the refused record was sent
