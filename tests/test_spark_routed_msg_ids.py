"""A routed task's msg-ids and prefix digests, without Spark: the ids the stream stores are
the core's derived ids (producer, partition, position, key, payload) and each partition's
digest covers exactly those ids in position order, whether the task computes the id from a
``nats_partition`` it was given (the fast path) or the core computes it."""

from __future__ import annotations

import asyncio
import hashlib

import nats
import pytest
from streamcheck import read_stream

pytest.importorskip("pyarrow")

from airflow_nats_ordered.core.msg_ids import derive_msg_id  # noqa: E402
from airflow_nats_ordered.core.partitioning import partition_for  # noqa: E402
from airflow_nats_ordered.core.publisher import PublisherConfig  # noqa: E402
from airflow_nats_ordered.core.streams import StreamSpec, provision  # noqa: E402
from airflow_nats_ordered.spark.resume import ResumingPublisher  # noqa: E402

P = 4


def test_routed_rows_get_the_core_msg_ids_and_digests_of_them(nats_url, unique_name):
    rows = [(f"key-{i % 7}", f'{{"i":{i}}}'.encode()) for i in range(60)]

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=P))
            pub = ResumingPublisher(
                nc,
                unique_name,
                PublisherConfig(producer_id="run-1"),
                resume={},
                run="run-1",
                label="t",
            )
            await pub.start()
            for n, (key, data) in enumerate(rows):
                # the first half as routed rows (partition given), the rest without it
                part = partition_for(key, P) if n < 30 else None
                await pub.publish(key, data, partition=part)
            await pub.close()
            return pub.digests(), await read_stream(nc, unique_name)
        finally:
            await nc.close()

    digests, stored = asyncio.run(go())
    want: dict[int, list[str]] = {}
    for key, data in rows:
        p = partition_for(key, P)
        want.setdefault(p, []).append(
            derive_msg_id("run-1", p, len(want.get(p, [])) + 1, key, data)
        )
    got: dict[int, list[str]] = {}
    for s in stored:
        got.setdefault(int(s.subject.rsplit(".", 1)[1]), []).append(s.msg_id)
    assert got == want
    for p, ids in want.items():
        h = hashlib.blake2b(digest_size=16)
        for mid in ids:
            h.update(mid.encode() + b"\n")
        assert digests[p] == f"{len(ids)}:{h.hexdigest()}"
