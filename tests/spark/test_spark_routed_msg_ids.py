"""A routed task's msg-ids and prefix digests, without Spark: the ids the stream stores are
the core's derived ids of the run's producer id and each row's rank among the run's rows of
its key (key, payload), the same whatever the stream's partition count, and each
partition's digest covers exactly those ids in position order."""

from __future__ import annotations

import asyncio
import hashlib

import nats
import pytest
from streamcheck import read_stream

pytest.importorskip("pyarrow")

from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id  # noqa: E402
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision  # noqa: E402
from airflow_nats_ordered.core.stream.partitioning import partition_for  # noqa: E402
from airflow_nats_ordered.spark.resume import ResumingPublisher  # noqa: E402

ROWS = [(f"key-{i % 7}", f'{{"i":{i}}}'.encode()) for i in range(60)]


def _publish_routed(url: str, stream: str, partitions: int):
    """ROWS as a routed task gets them: partition by partition, input order within each."""

    async def go():
        nc = await nats.connect(url)
        try:
            await provision(nc, StreamSpec(stream, partitions=partitions))
            pub = ResumingPublisher(
                nc,
                stream,
                PublisherConfig(producer_id="run-1"),
                resume={},
                run="run-1",
                label="t",
            )
            await pub.start()
            routed = sorted(ROWS, key=lambda r: partition_for(r[0], partitions))  # stable
            for key, data in routed:
                await pub.publish(key, data, partition=partition_for(key, partitions))
            await pub.close()
            return pub.digests(), await read_stream(nc, stream)
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.mark.parametrize("partitions", [4, 7])
def test_routed_rows_get_the_core_msg_ids_of_their_rank_in_their_key_and_digests_of_them(
    nats_url, unique_name, partitions
):
    digests, stored = _publish_routed(nats_url, unique_name, partitions)
    ranks: dict[str, int] = {}
    ids = {}
    for key, data in ROWS:
        ranks[key] = ranks.get(key, 0) + 1
        ids[data] = derive_msg_id("run-1", ranks[key], key, data)
    assert {s.data: s.msg_id for s in stored} == ids  # the same on 4 and on 7 partitions
    got: dict[int, list[str]] = {}
    for s in stored:
        got.setdefault(int(s.subject.rsplit(".", 1)[1]), []).append(s.msg_id)
    for p, mids in got.items():
        h = hashlib.blake2b(digest_size=16)
        for mid in mids:
            h.update(mid.encode() + b"\n")
        assert digests[p] == f"{len(mids)}:{h.hexdigest()}"
    assert sum(len(m) for m in got.values()) == len(ROWS)


def test_a_routed_rows_msg_id_is_the_same_on_any_partition_count(nats_url, unique_name):
    """Issue 28 item 1 on the Spark path: the same rows routed to 4 and to 7 partitions
    carry the same msg-ids, so a run published again after a repartition stores nothing
    twice inside the duplicate window."""
    _, on_4 = _publish_routed(nats_url, f"{unique_name}_4", 4)
    _, on_7 = _publish_routed(nats_url, f"{unique_name}_7", 7)
    assert {s.data: s.msg_id for s in on_4} == {s.data: s.msg_id for s in on_7}
    assert len({s.msg_id for s in on_4}) == len(ROWS)
