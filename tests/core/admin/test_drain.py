"""Waiting for a group to drain (core.admin.drain) against a real server and real workers."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.admin.drain_errors import (
    DrainTimeoutError,
    NoMembersError,
    PartitionBlockedError,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.commits import CommitRecord
from airflow_nats_ordered.core.group.lag import committed_positions, group_lag, needs_count
from airflow_nats_ordered.core.group.status import GroupState
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.group.stream_identity import StreamRecreated
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import PartitionStats, StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


async def _stream_with(nc, stream, n, partitions=4, keys=20):
    """A stream holding ``n`` records over ``keys`` keys; returns the high-water marks."""
    await provision(nc, StreamSpec(stream, partitions=partitions))
    async with OrderedPublisher(nc, stream) as pub:
        for i in range(n):
            await pub.publish(f"k{i % keys}", json.dumps({"i": i}).encode())
    summary = await pub.close()
    return {p.partition: p.last_seq for p in summary.partitions if p.last_seq}


def _cfg(stream, **kw):
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2, **kw)


def test_lag_takes_the_servers_count_wherever_sequences_cannot_tell():
    """Stream sequences are shared by all partitions: only a caught-up partition (0) and
    one that committed nothing (all its records) are known without the server's count of
    the records after the position; every other one takes that count, never a bound."""
    stats = [
        PartitionStats(0, "s.p.0", 0, 0),  # empty
        PartitionStats(1, "s.p.1", 30, 100),  # nothing committed
        PartitionStats(2, "s.p.2", 30, 100),  # committed in the middle
        PartitionStats(3, "s.p.3", 30, 100),  # caught up
    ]
    state = GroupState(
        commits={2: CommitRecord(40, 1, "m", 0.0), 3: CommitRecord(100, 1, "m", 0.0)},
        blocked={2: "x"},
    )
    positions = committed_positions(stats, state)
    assert positions == {0: 0, 1: 0, 2: 40, 3: 100}
    assert [needs_count(s, positions[s.partition]) for s in stats] == [False, False, True, False]
    with pytest.raises(ValueError, match="partition 2 committed 40 of 100"):
        group_lag("s", "g", stats, state)
    lag = group_lag("s", "g", stats, state, after={2: 7})
    assert [p.lag for p in lag.partitions] == [0, 30, 7, 0]
    assert (lag.total_lag, lag.drained, lag.partitions[2].blocked) == (37, False, "x")
    # another layout than the group's: its commits do not count there
    other = group_lag("s", "g", stats, state, layout_epoch=1)
    assert [p.lag for p in other.partitions] == [0, 30, 30, 30] and not other.drained


def test_wait_drained_waits_while_no_worker_runs_and_returns_once_they_commit(
    shared_nats_server, unique_name
):
    url = shared_nats_server.url
    seen: list[int] = []

    async def handler(msg):
        seen.append(json.loads(msg.data)["i"])

    async def go():
        nc = await nats.connect(url)
        marks = await _stream_with(nc, unique_name, 400)
        # the group exists (a member joined once) but nobody runs now
        await GroupStore.open(nc, _cfg(unique_name).group_config)
        before = await read_lag(nc, unique_name, "g")
        assert before.total_lag == 400 and not before.drained
        progress = []
        waiting = asyncio.ensure_future(
            wait_drained(nc, unique_name, "g", timeout=60, on_progress=progress.append)
        )
        await asyncio.sleep(1.5)
        assert not waiting.done(), "returned although nothing was processed"
        assert progress and progress[0].behind.keys() == marks.keys()
        t0 = time.monotonic()
        async with WorkerPool(url, _cfg(unique_name), handler, size=2):
            done = await asyncio.wait_for(waiting, 30)
            elapsed = time.monotonic() - t0
            after = await read_lag(nc, unique_name, "g")
        await nc.close()
        return marks, done, elapsed, after

    marks, done, elapsed, after = asyncio.run(go())
    assert done.done and dict(done.marks) == {p: marks.get(p, 0) for p in range(4)}
    assert all(done.committed[p] >= m for p, m in marks.items())
    assert sorted(set(seen)) == list(range(400))  # it returned after the work, not before
    assert after.drained and after.total_lag == 0
    assert elapsed < 20


def test_wait_drained_with_marks_waits_only_for_those_and_refuses_unknown_partitions(
    shared_nats_server, unique_name
):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        marks = await _stream_with(nc, unique_name, 100)
        await GroupStore.open(nc, _cfg(unique_name).group_config)
        # an empty set of marks (or marks at 0) is drained at once
        assert (await wait_drained(nc, unique_name, "g", marks={0: 0}, timeout=5)).done
        with pytest.raises(ConfigError, match=r"partitions \[7\].*0 to 3"):
            await wait_drained(nc, unique_name, "g", marks={7: 1}, timeout=5)
        with pytest.raises(DrainTimeoutError) as err:
            await wait_drained(nc, unique_name, "g", marks=marks, timeout=0.5)
        await nc.close()
        return marks, err.value

    marks, exc = asyncio.run(go())
    assert exc.behind == {p: (0, m) for p, m in sorted(marks.items())}
    assert "did not drain within 0.5s" in str(exc) and "nats-ordered status" in str(exc)


def test_wait_drained_fails_fast_on_a_blocked_partition(shared_nats_server, unique_name):
    url = shared_nats_server.url

    def handler(msg):
        if json.loads(msg.data)["i"] == 50:
            raise RuntimeError("downstream rejected")

    async def go():
        nc = await nats.connect(url)
        await _stream_with(nc, unique_name, 200)
        cfg = _cfg(unique_name, poison="block", max_retries=0)
        async with WorkerPool(ConnectionOptions(servers=(url,)), cfg, handler, size=1):
            # a wait that missed the block would end in DrainTimeoutError after 600 s
            with pytest.raises(PartitionBlockedError) as err:
                await wait_drained(nc, unique_name, "g", timeout=600)
        await nc.close()
        return err.value

    exc = asyncio.run(go())
    assert "downstream rejected" in exc.reason and f"partition {exc.partition}" in str(exc)
    assert "Fix the handler" in str(exc)


def test_wait_drained_on_a_group_without_state_says_how_to_start_one(
    shared_nats_server, unique_name
):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await _stream_with(nc, unique_name, 10, partitions=2)
        try:  # waited for (workers may be starting), within the no-members bound
            with pytest.raises(NoMembersError, match="has no state yet.*nats-ordered worker"):
                await wait_drained(nc, unique_name, "nobody", timeout=30, no_members_timeout=1)
        finally:
            await nc.close()

    asyncio.run(go())


def test_wait_drained_fails_fast_when_no_member_is_alive(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await _stream_with(nc, unique_name, 50)
        await GroupStore.open(nc, _cfg(unique_name).group_config)  # a group nobody runs
        # NoMembersError, not DrainTimeoutError after 600 s: it gave up for the right reason
        with pytest.raises(NoMembersError) as err:
            await wait_drained(nc, unique_name, "g", timeout=600, no_members_timeout=1.0)
        await nc.close()
        return err.value

    exc = asyncio.run(go())
    assert f"no worker pool is consuming group g of stream {unique_name}" in str(exc)
    assert "nats-ordered worker" in str(exc)


def test_a_live_member_keeps_the_no_members_check_quiet(shared_nats_server, unique_name):
    url = shared_nats_server.url

    async def slow(msg):
        await asyncio.sleep(0.002)

    async def go():
        nc = await nats.connect(url)
        marks = await _stream_with(nc, unique_name, 2000, keys=200)
        async with WorkerPool(url, _cfg(unique_name), slow, size=1):
            # longer than no_members_timeout: only a live member keeps it going
            done = await wait_drained(
                nc, unique_name, "g", marks=marks, timeout=60, no_members_timeout=0.5
            )
        await nc.close()
        return done

    assert asyncio.run(go()).done


def test_wait_drained_refuses_a_recreated_stream(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await _stream_with(nc, unique_name, 20)
        await GroupStore.open(nc, _cfg(unique_name).group_config)
        await nc.jetstream().delete_stream(unique_name)
        await _stream_with(nc, unique_name, 5)
        with pytest.raises(StreamRecreated) as err:
            await wait_drained(nc, unique_name, "g", timeout=30)
        await nc.close()
        return err.value

    exc = asyncio.run(go())
    assert "deleted and created again" in str(exc) and "group delete" in str(exc)


def test_a_blocked_marker_older_than_the_latest_grant_does_not_fail_the_wait(
    shared_nats_server, unique_name
):
    """Between a new owner's grant (it retries the poison message with a fixed handler) and
    its first applied message, the marker is still there: the wait must not fail on it."""

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await _stream_with(nc, unique_name, 40, partitions=1)
        store = await GroupStore.open(nc, _cfg(unique_name).group_config)
        await store.grant(0, "old-owner")
        await store.set_blocked(0, "blocked at seq 7 after 1 attempts: RuntimeError: boom")
        with pytest.raises(PartitionBlockedError):
            await wait_drained(nc, unique_name, "g", timeout=5)
        await store.grant(0, "new-owner")  # the fixed handler's member claims it
        with pytest.raises(DrainTimeoutError):
            await wait_drained(nc, unique_name, "g", timeout=1.5)
        await nc.close()

    asyncio.run(go())
