"""Provisioning: idempotent create-or-verify, the metadata contract, refusals that say why."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js import api

from airflow_nats_ordered.core.errors import (
    ConfigError,
    PartitionMismatchError,
    StreamConflictError,
    StreamNotFoundError,
)
from airflow_nats_ordered.core.stream.partitioned import (
    META_PARTITIONS,
    StreamSpec,
    describe,
    partition_stats,
    provision,
)


def run(coro):
    return asyncio.run(coro)


async def _with_nc(url, fn):
    nc = await nats.connect(url)
    try:
        return await fn(nc)
    finally:
        await nc.close()


def test_provision_is_idempotent_and_records_the_contract(shared_nats_server, unique_name):
    spec = StreamSpec(unique_name, partitions=8)

    async def go(nc):
        first = await provision(nc, spec)
        again = await provision(nc, spec)
        info = await nc.jetstream().stream_info(unique_name)
        return first, again, info

    first, again, info = run(_with_nc(shared_nats_server.url, go))
    assert first.action == "created" and again.action == "unchanged" and again.changes == ()
    meta = info.config.metadata
    assert meta[META_PARTITIONS] == "8"
    assert meta["nats-ordered.hash"] == "murmur3_x86_32" and meta["nats-ordered.seed"] == "0"
    # exactly the partition subjects: the server refuses a publish to any other subject
    assert info.config.subjects == [f"{unique_name.lower()}.p.{p}" for p in range(8)]
    assert info.config.allow_batched is True
    assert info.config.duplicate_window == pytest.approx(3600)


def test_safe_changes_are_applied_in_place(shared_nats_server, unique_name):
    async def go(nc):
        await provision(nc, StreamSpec(unique_name, partitions=4))
        res = await provision(
            nc,
            StreamSpec(
                unique_name,
                partitions=4,
                duplicate_window=7200,
                max_age=86400,
                description="orders",
            ),
        )
        return res, await nc.jetstream().stream_info(unique_name)

    res, info = run(_with_nc(shared_nats_server.url, go))
    assert res.action == "updated"
    assert "duplicate_window: 3600s -> 7200s" in res.changes
    assert any(c.startswith("max_age") for c in res.changes)
    assert info.config.duplicate_window == pytest.approx(7200)
    assert info.config.max_age == pytest.approx(86400)
    assert info.config.metadata[META_PARTITIONS] == "4"


def test_partition_count_cannot_change_in_place(shared_nats_server, unique_name):
    async def go(nc):
        await provision(nc, StreamSpec(unique_name, partitions=16))
        with pytest.raises(PartitionMismatchError) as err:
            await provision(nc, StreamSpec(unique_name, partitions=8))
        return str(err.value), await describe(nc, unique_name)

    msg, desc = run(_with_nc(shared_nats_server.url, go))
    assert "has 16 partitions in its metadata but 8 were requested" in msg
    assert "cannot change in place" in msg and "--partitions 16" in msg
    assert desc.partitions == 16  # nothing was changed


def test_prefix_and_storage_conflicts_say_what_differs(shared_nats_server, unique_name):
    async def go(nc):
        await provision(nc, StreamSpec(unique_name, partitions=2, subject_prefix="a.b"))
        with pytest.raises(StreamConflictError, match="uses subject prefix 'a.b'"):
            await provision(nc, StreamSpec(unique_name, partitions=2, subject_prefix="c"))
        with pytest.raises(StreamConflictError, match="file storage but memory was requested"):
            await provision(
                nc, StreamSpec(unique_name, partitions=2, subject_prefix="a.b", storage="memory")
            )

    run(_with_nc(shared_nats_server.url, go))


def test_overlapping_subjects_are_refused_naming_the_other_stream(shared_nats_server, unique_name):
    async def go(nc):
        await nc.jetstream().add_stream(name=f"{unique_name}_OTHER", subjects=["ovl.>"])
        with pytest.raises(StreamConflictError, match=f"overlap stream\\(s\\) {unique_name}_OTHER"):
            await provision(nc, StreamSpec(unique_name, partitions=2, subject_prefix="ovl.x"))

    run(_with_nc(shared_nats_server.url, go))


def test_foreign_stream_is_not_mistaken_for_a_partitioned_one(shared_nats_server, unique_name):
    async def go(nc):
        await nc.jetstream().add_stream(
            api.StreamConfig(name=unique_name, subjects=[f"{unique_name.lower()}.p.*"])
        )
        with pytest.raises(StreamConflictError, match="not a partitioned stream"):
            await provision(nc, StreamSpec(unique_name, partitions=2))
        with pytest.raises(StreamConflictError, match="not created by nats-ordered"):
            await describe(nc, unique_name)

    run(_with_nc(shared_nats_server.url, go))


def test_missing_stream_error_says_how_to_create_it(shared_nats_server, unique_name):
    async def go(nc):
        with pytest.raises(StreamNotFoundError, match="nats-ordered provision --stream"):
            await describe(nc, unique_name)

    run(_with_nc(shared_nats_server.url, go))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "has.dot"}, "stream name"),
        ({"name": "S", "partitions": 0}, "partitions must be"),
        ({"name": "S", "subject_prefix": "a.*"}, "subject prefix"),
        ({"name": "S", "duplicate_window": 0}, "duplicate_window must be > 0"),
        ({"name": "S", "max_age": 60, "duplicate_window": 120}, "max_age"),
        ({"name": "S", "replicas": 7}, "replicas"),
    ],
)
def test_bad_specs_are_refused_before_touching_the_server(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        StreamSpec(**kwargs)


def test_partition_stats_counts_and_last_sequences(shared_nats_server, unique_name):
    async def go(nc):
        await provision(nc, StreamSpec(unique_name, partitions=3, subject_prefix=unique_name))
        js = nc.jetstream()
        acks = [await js.publish(f"{unique_name}.p.{p}", b"x") for p in (0, 2, 2)]
        return acks, await partition_stats(nc, unique_name)

    acks, stats = run(_with_nc(shared_nats_server.url, go))
    assert [(s.partition, s.messages) for s in stats] == [(0, 1), (1, 0), (2, 2)]
    assert stats[0].last_seq == acks[0].seq and stats[1].last_seq == 0
    assert stats[2].last_seq == acks[2].seq
