"""Fencing tokens never go back, and a missing commit record is resolved by an explicit policy
(issue 7 item 6), against a real server."""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.commits import CommitRecordMissing, next_token
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


async def _setup(url, name, messages=0, **cfg):
    """A 2-partition stream with ``messages`` messages on partition 0 (seqs 1..n), a store."""
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(name, partitions=2))
    js = nc.jetstream()
    for i in range(messages):
        await js.publish(f"{name.lower()}.p.0", b"m%d" % i)
    store = await GroupStore.open(nc, GroupConfig(name, "g", **cfg))
    return nc, store


async def _reopen(nc, name, **cfg):
    return await GroupStore.open(nc, GroupConfig(name, "g", **cfg))


def test_next_token_exceeds_the_previous_token_the_sink_floor_and_follows_the_clock():
    assert next_token(0, 0, 1000) == 1000
    assert next_token(5000, 0, 1000) == 5001  # a clock behind the record never goes back
    assert next_token(7, 9000, 1000) == 9001  # the sink saw a higher token
    assert next_token(0, 0, 0) == 1


def test_tokens_keep_growing_after_the_state_bucket_is_recreated(shared_nats_server, unique_name):
    async def go():
        nc, store = await _setup(shared_nats_server.url, unique_name)
        tokens = [(await store.grant(0, f"m{i}")).token for i in range(3)]
        # an operator removes the state bucket; a member re-creates it on its next start
        await nc.jetstream().delete_key_value(store.cfg.state_bucket)
        store = await _reopen(nc, unique_name)
        after = await store.grant(0, "new")  # no sink floor known: the clock alone
        await nc.close()
        return tokens, after

    tokens, after = asyncio.run(go())
    assert tokens == sorted(set(tokens))
    assert after.token > max(tokens), (tokens, after.token)


def test_a_deleted_commit_record_is_refused_by_default_and_reported(
    shared_nats_server, unique_name
):
    async def go():
        nc, store = await _setup(shared_nats_server.url, unique_name, messages=5)
        g = await store.grant(0, "a")
        await store.commit(g, 3)
        await store.state.delete("c.0")
        with pytest.raises(CommitRecordMissing) as err:
            await store.grant(0, "b")
        snap = await store.snapshot()
        await nc.close()
        return err.value, snap

    err, snap = asyncio.run(go())
    msg = str(err)
    assert err.partition == 0
    assert "partition 0" in msg and "missing_commit" in msg and "--missing-commit" in msg
    assert "'earliest'" in msg and "'latest'" in msg
    assert any("commit record c.0 was deleted" in p for p in snap.problems), snap.problems


def test_earliest_policy_resumes_at_the_partitions_first_message_with_a_larger_token(
    shared_nats_server, unique_name
):
    async def go():
        nc, store = await _setup(shared_nats_server.url, unique_name, messages=5)
        g = await store.grant(0, "a")
        await store.commit(g, 4)
        await store.state.delete("c.0")
        store = await _reopen(nc, unique_name, missing_commit="earliest")
        after = await store.grant(0, "b")
        await nc.close()
        return g, after

    g, after = asyncio.run(go())
    assert after.token > g.token
    assert after.committed == 0  # the reader starts at committed + 1: seq 1, the first message


def test_earliest_policy_starts_at_the_first_message_still_stored(shared_nats_server, unique_name):
    async def go():
        nc, store = await _setup(
            shared_nats_server.url, unique_name, messages=6, missing_commit="earliest"
        )
        g = await store.grant(0, "a")
        await store.commit(g, 5)
        # the oldest messages of partition 0 are gone (limits, purge): seqs 1..3
        await nc.jetstream().purge_stream(unique_name, subject=f"{unique_name.lower()}.p.0", seq=4)
        await store.state.purge("c.0")
        after = await store.grant(0, "b")
        await nc.close()
        return g, after

    g, after = asyncio.run(go())
    assert after.committed == 3 and after.token > g.token


def test_latest_policy_resumes_after_the_partitions_last_message(shared_nats_server, unique_name):
    async def go():
        nc, store = await _setup(
            shared_nats_server.url, unique_name, messages=5, missing_commit="latest"
        )
        js = nc.jetstream()
        await js.publish(f"{unique_name.lower()}.p.1", b"other partition")  # seq 6
        g = await store.grant(0, "a")
        await store.commit(g, 2)
        await store.state.delete("c.0")
        after = await store.grant(0, "b")
        await nc.close()
        return g, after

    g, after = asyncio.run(go())
    assert after.committed == 5 and after.token > g.token  # partition 0's last, not the stream's


def test_the_sink_floor_reveals_a_recreated_state_bucket(shared_nats_server, unique_name):
    async def go():
        nc, store = await _setup(shared_nats_server.url, unique_name, messages=3)
        g = await store.grant(0, "a")
        await store.commit(g, 3)
        await nc.jetstream().delete_key_value(store.cfg.state_bucket)
        store = await _reopen(nc, unique_name)
        # the sink has fenced with g.token: the partition had a commit record
        with pytest.raises(CommitRecordMissing, match="re-created or purged"):
            await store.grant(0, "b", floor=g.token)
        # a partition the sink never saw is new: it starts at its beginning
        fresh = await store.grant(1, "b", floor=0)
        store = await _reopen(nc, unique_name, missing_commit="earliest")
        after = await store.grant(0, "b", floor=g.token)
        await nc.close()
        return g, fresh, after

    g, fresh, after = asyncio.run(go())
    assert fresh.committed == 0
    assert after.token > g.token and after.committed == 0


def test_a_token_far_above_the_clock_still_grows_by_one(shared_nats_server, unique_name):
    async def go():
        nc, store = await _setup(shared_nats_server.url, unique_name, missing_commit="earliest")
        huge = 10**15  # e.g. a member whose clock ran far ahead issued it
        g = await store.grant(0, "a", floor=huge - 1)
        g2 = await store.grant(0, "b")
        await nc.close()
        return g, g2

    g, g2 = asyncio.run(go())
    assert g.token == 10**15 and g2.token == 10**15 + 1


def test_an_unknown_missing_commit_policy_is_refused():
    with pytest.raises(ConfigError, match="missing_commit must be one of fail, earliest, latest"):
        GroupConfig("S", "g", missing_commit="oldest")
