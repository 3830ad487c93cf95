"""The group's state is replicated like its stream (issue 7 item 5), in a real 3-node cluster:
losing the server that leads the state bucket neither stops the group nor loses or reorders
anything."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import nats
import pytest
from nats import errors as nats_errors
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from streamcheck import read_stream

from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

PARTITIONS = 4


def in_order_at_least_once_problems(delivered: list[int], stored: list[int]) -> list[str]:
    """How ``delivered`` (stream seqs handed to the handler, in order) breaks in-order
    at-least-once delivery of ``stored`` (the partition's seqs, ascending): every message
    is delivered, and each re-delivery is a contiguous replay that starts no later than
    where the previous run stopped (a new owner resumes at its committed position)."""
    index = {s: i for i, s in enumerate(stored)}
    nxt = high = 0  # next index of the current run; count of distinct messages delivered
    for n, seq in enumerate(delivered):
        j = index.get(seq)
        if j is None:
            return [f"delivery #{n} is seq {seq}, which is not in the partition"]
        if j > nxt:
            return [
                f"delivery #{n} is seq {seq} but seq {stored[nxt]} was due (skipped or reordered)"
            ]
        nxt = j + 1
        high = max(high, nxt)
    if high < len(stored):
        return [f"{len(stored) - high} message(s) never delivered, from seq {stored[high]}"]
    return []


def test_the_checker_refuses_a_replay_that_is_not_contiguous():
    assert in_order_at_least_once_problems([1, 2, 3, 4, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == []
    assert in_order_at_least_once_problems([1, 2, 3, 4, 2, 5], [1, 2, 3, 4, 5])
    assert in_order_at_least_once_problems([1, 3, 2], [1, 2, 3])
    assert in_order_at_least_once_problems([1, 2], [1, 2, 3])


async def _publish(js, name: str, n: int, start: int) -> None:
    """Publish ``n`` messages round-robin over the partitions, one at a time, retrying each
    with its msg-id through leader elections (so nothing is stored twice or out of order)."""
    for i in range(start, start + n):
        subject = f"{name.lower()}.p.{i % PARTITIONS}"
        deadline = time.monotonic() + 30
        while True:
            try:
                await js.publish(subject, b"m%d" % i, headers={"Nats-Msg-Id": f"m{i}"})
                break
            except (
                nats_errors.TimeoutError,
                nats_errors.NoRespondersError,
                NoStreamResponseError,
                ServiceUnavailableError,
            ):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


@pytest.mark.cluster
def test_killing_the_state_bucket_leader_neither_stops_nor_loses_nor_reorders(
    nats_cluster, unique_name
):
    cfg = WorkerConfig(
        unique_name,
        "g",
        lease_ttl=3.0,
        commit_every=5,
        commit_interval=0.1,
        fetch_batch=20,
    )
    state_stream = f"KV_{GroupConfig(unique_name, 'g').state_bucket}"
    delivered: dict[int, list[int]] = defaultdict(list)
    handled = 0

    async def handle(msg):
        nonlocal handled
        delivered[msg.partition].append(msg.stream_seq)
        handled += 1
        await asyncio.sleep(0.002)

    async def go():
        nc = await nats.connect(nats_cluster.urls, max_reconnect_attempts=-1)
        js = nc.jetstream(timeout=2)
        await provision(nc, StreamSpec(unique_name, partitions=PARTITIONS, replicas=3))
        await _publish(js, unique_name, 200, 0)
        pool = WorkerPool(ConnectionOptions(servers=tuple(nats_cluster.urls)), cfg, handle, size=2)
        async with pool:
            while handled < 100:
                await asyncio.sleep(0.05)
            replicas = (await js.stream_info(state_stream)).config.num_replicas
            victim = nats_cluster.stream_leader(state_stream)
            nats_cluster.kill(victim)
            killed_at = handled
            await _publish(js, unique_name, 300, 200)
            stored = await read_stream(nc, unique_name)
            by_part: dict[int, list[int]] = defaultdict(list)
            for s in stored:
                by_part[int(s.subject.rsplit(".", 1)[1])].append(s.seq)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if all(set(delivered[p]) >= set(by_part[p]) for p in by_part):
                    break
                await asyncio.sleep(0.1)
            stats = pool.stats
        await nc.close()
        return replicas, victim, killed_at, stored, by_part, stats

    replicas, victim, killed_at, stored, by_part, stats = asyncio.run(go())
    assert len(stored) == 500, f"{len(stored)} messages stored, 500 published"
    problems = [
        f"partition {p}: {problem}"
        for p in sorted(by_part)
        for problem in in_order_at_least_once_problems(delivered[p], by_part[p])
    ]
    assert not problems, (
        f"after killing server {victim} (state bucket leader) at {killed_at} handled "
        f"(stats {stats}): " + "; ".join(problems)
    )
    assert replicas == 3, f"the state bucket has {replicas} replica(s), the stream 3"
