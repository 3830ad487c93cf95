"""Where a drain wait on given marks stands (core.admin.overview.drain_wait_status, what the
UI view shows for a DAG run's drain sensor), against a real server and real workers: the
lag to a mark counts the partition's records up to the mark only, not those after it, and
is checked against an independent count of the stored records."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.admin.overview import drain_wait_status, group_status
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

PARTITIONS = 3


async def _publish(nc, stream: str, start: int, n: int) -> None:
    async with OrderedPublisher(nc, stream) as pub:
        for i in range(start, start + n):
            await pub.publish(f"k{i % 11}", json.dumps({"i": i}).encode())


async def _records(nc, stream: str) -> list[tuple[int, str]]:
    """Every stored record's (sequence, subject), read one by one."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        out.append((seq, msg.subject))
    return out


def test_the_lag_to_a_mark_counts_only_the_records_up_to_it(shared_nats_server, unique_name):
    url = shared_nats_server.url

    async def handler(msg) -> None:
        pass

    async def go():
        nc = await nats.connect(url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=PARTITIONS))
            await _publish(nc, unique_name, 0, 30)
            described = await describe(nc, unique_name)
            records = await _records(nc, unique_name)
            # marks in the middle of each partition: its 3rd record
            marks = {}
            for p in range(PARTITIONS):
                seqs = [s for s, subj in records if subj == described.subject(p)]
                marks[str(p)] = seqs[2]

            # no group yet: nothing committed, each partition's records up to its mark
            before = await drain_wait_status(nc, unique_name, "g", marks)
            assert not before["group_exists"] and not before["drained"]
            shown = [(m["partition"], m["committed"], m["lag_to_mark"]) for m in before["marks"]]
            assert shown == [(p, 0, 3) for p in range(PARTITIONS)]
            assert before["behind"] == list(range(PARTITIONS))

            # drained up to everything, then more published: the old marks are met although
            # the group lags again
            cfg = WorkerConfig(unique_name, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2)
            async with WorkerPool(url, cfg, handler, size=1) as pool:
                await pool.wait_assigned(30)
                await wait_drained(nc, unique_name, "g", timeout=60)
            await _publish(nc, unique_name, 30, 12)
            status = await group_status(nc, unique_name, "g")
            after = await drain_wait_status(nc, unique_name, "g", marks)
            last_marks = {str(p["partition"]): p["last"] for p in status["partitions"]}
            against_last = await drain_wait_status(nc, unique_name, "g", last_marks)
            return status, after, against_last
        finally:
            await nc.close()

    status, after, against_last = asyncio.run(go())
    assert status["total_lag"] == 12
    assert after["drained"] and after["behind"] == [] and after["group_exists"]
    assert all(m["lag_to_mark"] == 0 and not m["behind"] for m in after["marks"])
    # marks at the last sequences: the lag to them is status's lag, partition by partition
    assert [(m["committed"], m["lag_to_mark"]) for m in against_last["marks"]] == [
        (p["committed"], p["lag"]) for p in status["partitions"]
    ]
    assert against_last["behind"] == [p["partition"] for p in status["partitions"] if p["lag"]]
