"""Deleting a consumer group (core.admin.delete) against a real server and real workers."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from nats.js.errors import BucketNotFoundError, NotFoundError

from airflow_nats_ordered.core.admin.delete import GroupInUseError, delete_group
from airflow_nats_ordered.core.admin.dlq import dead_letter_stream, dead_letters
from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError, live_members
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

N = 200


async def _stream_with(nc, stream, n=N, partitions=4):
    await provision(nc, StreamSpec(stream, partitions=partitions))
    async with OrderedPublisher(nc, stream) as pub:
        for i in range(n):
            await pub.publish(f"k{i % 20}", json.dumps({"i": i}).encode())


def _cfg(stream, group, **kw):
    return WorkerConfig(stream, group, member_id=group, lease_ttl=2.0, commit_interval=0.2, **kw)


def _rejects_every_tenth(msg):
    if json.loads(msg.data)["i"] % 10 == 0:
        raise RuntimeError("rejected")


async def _run_group_until_drained(url, nc, stream, group, handler=_rejects_every_tenth):
    cfg = _cfg(stream, group, max_retries=0, retry_backoff=0.01)
    async with WorkerPool(url, cfg, handler, size=1):
        await wait_drained(nc, stream, group, timeout=30)


async def _buckets_exist(nc, stream, group):
    cfg = GroupConfig(stream, group)
    out = []
    for bucket in (cfg.lease_bucket, cfg.state_bucket):
        try:
            await nc.jetstream().key_value(bucket)
            out.append(True)
        except (BucketNotFoundError, NotFoundError):
            out.append(False)
    return out


def test_delete_refuses_while_a_member_is_alive_and_then_removes_both_buckets(
    shared_nats_server, unique_name
):
    url = shared_nats_server.url
    seen = []

    async def go():
        nc = await nats.connect(url)
        await _stream_with(nc, unique_name)
        async with WorkerPool(url, _cfg(unique_name, "g"), seen.append, size=1) as pool:
            await wait_drained(nc, unique_name, "g", timeout=30)
            assert await live_members(nc, unique_name, "g") == pool.members
            with pytest.raises(GroupInUseError) as refused:
                await delete_group(nc, unique_name, "g")
            assert await _buckets_exist(nc, unique_name, "g") == [True, True]
        assert await live_members(nc, unique_name, "g") == []  # left gracefully
        done = await delete_group(nc, unique_name, "g")
        after = await _buckets_exist(nc, unique_name, "g")
        with pytest.raises(GroupNotFoundError, match="does not exist"):
            await delete_group(nc, unique_name, "g")
        # a group started again under the same name starts over from the first message
        seen.clear()
        async with WorkerPool(url, _cfg(unique_name, "g"), seen.append, size=1):
            await wait_drained(nc, unique_name, "g", timeout=30)
        await nc.close()
        return refused.value, done, after

    refused, done, after = asyncio.run(go())
    assert refused.members == ["g-1"]
    assert "Stop its workers first" in str(refused) and "force=True" in str(refused)
    assert done.buckets == [f"nor_{unique_name}_g_leases", f"nor_{unique_name}_g_state"]
    assert done.live_members == [] and done.dead_letters_purged == 0
    assert after == [False, False]
    assert len(seen) == N


def test_forced_delete_removes_the_group_under_a_live_member(shared_nats_server, unique_name):
    url = shared_nats_server.url

    async def go():
        nc = await nats.connect(url)
        await _stream_with(nc, unique_name, n=10)
        pool = WorkerPool(url, _cfg(unique_name, "g"), lambda m: None, size=1)
        await pool.start()
        try:
            await wait_drained(nc, unique_name, "g", timeout=30)
            done = await delete_group(nc, unique_name, "g", force=True)
            after = await _buckets_exist(nc, unique_name, "g")
        finally:
            await pool.stop()
            await nc.close()
        return done, after

    done, after = asyncio.run(go())
    assert done.live_members == ["g-1"] and len(done.buckets) == 2
    assert after == [False, False]


def test_dead_letters_are_kept_unless_asked_and_the_shared_stream_goes_only_when_unused(
    shared_nats_server, unique_name
):
    url = shared_nats_server.url
    dlq = dead_letter_stream(unique_name)

    async def go():
        nc = await nats.connect(url)
        js = nc.jetstream()
        await _stream_with(nc, unique_name)
        for group in ("g1", "g2", "g3"):
            await _run_group_until_drained(url, nc, unique_name, group)
        counts = {g: (await dead_letters(nc, unique_name, g)).messages for g in ("g1", "g2")}
        # without dead_letters: the group's dead letters stay
        kept = await delete_group(nc, unique_name, "g3")
        after_kept = (await dead_letters(nc, unique_name, "g3")).messages
        # g1's purged; g2's (and g3's) remain, so the shared stream is kept
        first = await delete_group(nc, unique_name, "g1", dead_letters=True)
        left = {g: (await dead_letters(nc, unique_name, g)).messages for g in ("g1", "g2")}
        await js.purge_stream(dlq, subject=f"{unique_name.lower()}.dlq.g3.*")
        # g2's purged: the stream is empty but... no other group has state: deleted
        second = await delete_group(nc, unique_name, "g2", dead_letters=True)
        with pytest.raises(NotFoundError):
            await js.stream_info(dlq)
        gone = await dead_letters(nc, unique_name, "g2")
        await nc.close()
        return counts, kept, after_kept, first, left, second, gone

    counts, kept, after_kept, first, left, second, gone = asyncio.run(go())
    assert counts == {"g1": N // 10, "g2": N // 10}
    assert kept.dead_letters_purged == 0 and after_kept == N // 10
    assert first.dead_letters_purged == N // 10 and not first.dead_letter_stream_deleted
    assert "other groups" in first.dead_letter_stream_kept
    assert left == {"g1": 0, "g2": N // 10}
    assert second.dead_letters_purged == N // 10 and second.dead_letter_stream_deleted
    assert not gone.exists and gone.messages == 0


def test_an_empty_dead_letter_stream_is_kept_while_another_group_has_state(
    shared_nats_server, unique_name
):
    """Deleting the shared stream under another group would break its dead-lettering."""
    url = shared_nats_server.url

    async def go():
        nc = await nats.connect(url)
        await _stream_with(nc, unique_name)
        await _run_group_until_drained(url, nc, unique_name, "g1")
        await _run_group_until_drained(url, nc, unique_name, "other", handler=lambda m: None)
        done = await delete_group(nc, unique_name, "g1", dead_letters=True)
        info = await nc.jetstream().stream_info(dead_letter_stream(unique_name))
        await nc.close()
        return done, info

    done, info = asyncio.run(go())
    assert done.dead_letters_purged == N // 10 and not done.dead_letter_stream_deleted
    assert f"nor_{unique_name}_other_state" in done.dead_letter_stream_kept
    assert info.state.messages == 0
