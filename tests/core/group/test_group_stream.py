"""The group's state follows its stream: replicas and identity (issue 7 items 5 and 7)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.group.stream_identity import StreamRecreated
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


async def _publish(nc, name, n, partition=0):
    for i in range(n):
        await nc.jetstream().publish(f"{name.lower()}.p.{partition}", b"m%d" % i)


def test_a_recreated_stream_is_refused_with_what_to_do(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        js = nc.jetstream()
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await _publish(nc, unique_name, 5)
        running = await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        g = await running.grant(0, "a")
        await running.commit(g, 5)
        # deleted and created again under the same name, with new messages
        await js.delete_stream(unique_name)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await _publish(nc, unique_name, 3)
        with pytest.raises(StreamRecreated) as at_open:
            await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        with pytest.raises(StreamRecreated):  # a member that was running meanwhile
            await running.grant(0, "b")
        snap = await (await GroupStore.attach(nc, unique_name, "g")).snapshot()
        await nc.close()
        return str(at_open.value), snap

    msg, snap = asyncio.run(go())
    assert f"stream {unique_name} was deleted and created again" in msg
    assert f"nats-ordered group delete --stream {unique_name} --group g" in msg
    assert "reset the sink" in msg
    assert any("was deleted and created again" in p for p in snap.problems), snap.problems


def test_commit_records_of_another_stream_incarnation_are_refused(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        store = await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        g = await store.grant(0, "a")
        await store.commit(g, 7)
        await nc.jetstream().delete_stream(unique_name)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await store.state.delete("stream")  # the group-level record is gone, c.0 is not
        fresh = await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        with pytest.raises(StreamRecreated):
            await fresh.grant(0, "b")
        await nc.close()

    asyncio.run(go())


def test_the_stream_identity_survives_a_server_restart(nats_server, unique_name):
    async def first():
        nc = await nats.connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        store = await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        g = await store.grant(0, "a")
        await store.commit(g, 3)
        await nc.close()
        return g

    async def again():
        nc = await nats.connect(nats_server.url)
        store = await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        g = await store.grant(0, "b")
        snap = await store.snapshot()
        await nc.close()
        return g, snap

    g1 = asyncio.run(first())
    nats_server.restart()
    g2, snap = asyncio.run(again())
    assert g2.committed == 3 and g2.token > g1.token and snap.problems == []


def test_group_buckets_take_the_streams_replicas_unless_overridden(nats_cluster, unique_name):
    async def go():
        nc = await nats.connect(nats_cluster.urls)
        js = nc.jetstream()
        await provision(nc, StreamSpec(unique_name, partitions=2, replicas=3))
        default = await GroupStore.open(nc, GroupConfig(unique_name, "g"))
        explicit = await GroupStore.open(nc, GroupConfig(unique_name, "h", replicas=1))
        got = {}
        for store in (default, explicit):
            for bucket in (store.cfg.lease_bucket, store.cfg.state_bucket):
                got[bucket] = (await js.stream_info(f"KV_{bucket}")).config.num_replicas
        # an R1 group (as earlier versions made them) is raised to the stream's count
        await GroupStore.open(nc, GroupConfig(unique_name, "h"))
        raised = (await js.stream_info(f"KV_{explicit.cfg.state_bucket}")).config.num_replicas
        # but a group made R3 on purpose is not lowered by a member using the default
        await provision(nc, StreamSpec(unique_name, partitions=2, replicas=1))
        await GroupStore.open(nc, GroupConfig(unique_name, "h"))
        kept = (await js.stream_info(f"KV_{explicit.cfg.state_bucket}")).config.num_replicas
        # and one member asking for fewer on purpose is refused, not obeyed for everyone
        with pytest.raises(ConfigError, match="never lowers the group's state"):
            await GroupStore.open(nc, GroupConfig(unique_name, "h", replicas=1))
        still = (await js.stream_info(f"KV_{explicit.cfg.state_bucket}")).config.num_replicas
        await nc.close()
        return default.cfg, explicit.cfg, got, raised, kept, still

    d, e, got, raised, kept, still = asyncio.run(go())
    assert got == {d.lease_bucket: 3, d.state_bucket: 3, e.lease_bucket: 1, e.state_bucket: 1}
    assert raised == 3 and kept == 3 and still == 3
