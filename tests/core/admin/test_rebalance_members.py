"""A rebalance names members and partitions that exist (issue 30, defect 2): a cordon of a
member id the group does not know (``worker-2`` in a group of ``vm-1``, ``vm-2``) used to
succeed with no move and no word; weights for a partition the group does not have were
dropped silently. Both are refused now, naming what the group has, before anything is
written. A member that is known but not live (cordoned earlier and stopped for its
maintenance) may stay cordoned. Real nats-server, real workers."""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core import rebalance_group
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


def _cfg(stream: str) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="vm", lease_ttl=2.0, commit_interval=0.1)


async def _handler(msg) -> None:
    pass


async def _policy_and_assignment(nc, stream: str) -> tuple[object, bytes | None]:
    store = await GroupStore.attach(nc, stream, "g")
    policy, _ = await store.read_policy()
    data, _ = await store.read_assignment()
    return policy, data


def test_a_cordon_of_an_unknown_member_is_refused_naming_the_live_members(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with WorkerPool(nats_url, _cfg(unique_name), _handler, size=2) as pool:
            await pool.wait_assigned(30)
            assert sorted(pool.members) == ["vm-1", "vm-2"]
            before = await _policy_and_assignment(nc, unique_name)
            with pytest.raises(ConfigError) as refused:
                await rebalance_group(
                    nc, unique_name, "g", cordon=["vm-1", "worker-2", "worker-1"], timeout=30
                )
            after = await _policy_and_assignment(nc, unique_name)
        await nc.close()
        return str(refused.value), before, after

    message, before, after = asyncio.run(go())
    assert "worker-1, worker-2" in message, message
    assert "vm-1, vm-2" in message, message  # the group's live members, to pick from
    assert after == before, "a refused rebalance wrote a policy or an assignment"


def test_weights_of_a_partition_the_group_does_not_have_are_refused(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with WorkerPool(nats_url, _cfg(unique_name), _handler, size=2) as pool:
            await pool.wait_assigned(30)
            with pytest.raises(ConfigError) as refused:
                await rebalance_group(
                    nc, unique_name, "g", weights={0: 5.0, 1: 1.0, 7: 9.0, -1: 1.0}, timeout=30
                )
            ok = await rebalance_group(nc, unique_name, "g", weights={0: 5.0, 3: 1.0}, timeout=30)
        await nc.close()
        return str(refused.value), ok

    message, ok = asyncio.run(go())
    assert "-1, 7" in message and "0..3" in message, message
    assert sorted(ok.owners) == [0, 1, 2, 3]


def test_a_cordoned_member_that_left_may_stay_cordoned_but_a_stranger_may_not(
    nats_url, unique_name
):
    """vm-3 is cordoned, then stopped for its maintenance; adding vm-2 to the cordon must
    name vm-3 again (each request replaces the cordon), which is accepted although vm-3 is
    not live. A member id that is neither live, nor owns partitions, nor is cordoned is
    still refused."""

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=6))
        async with WorkerPool(nats_url, _cfg(unique_name), _handler, size=3) as pool:
            await pool.wait_assigned(30)
            first = await rebalance_group(nc, unique_name, "g", cordon=["vm-3"], timeout=30)
            await pool.remove("vm-3")  # leaves the group (its heartbeat deleted)
            both = await rebalance_group(nc, unique_name, "g", cordon=["vm-3", "vm-2"], timeout=30)
            policy, _ = await _policy_and_assignment(nc, unique_name)
            with pytest.raises(ConfigError) as refused:
                await rebalance_group(nc, unique_name, "g", cordon=["vm-4"], timeout=30)
        await nc.close()
        return first, both, policy, str(refused.value)

    first, both, policy, message = asyncio.run(go())
    assert "vm-3" not in first.owners.values()
    assert set(both.owners.values()) == {"vm-1"}
    assert policy.cordon == ["vm-2", "vm-3"]
    assert "vm-4" in message and "vm-1, vm-2" in message, message
