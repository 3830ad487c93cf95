"""Explicit rebalances: cordon members before maintenance, balance by measured load, with
the leader applying them and the group settling (real nats-server, real workers)."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.admin.rebalance import partition_rates, rebalance_group
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.assignor import Assignment
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


def _cfg(stream: str) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="w", lease_ttl=2.0, commit_interval=0.1)


async def _publish(nc, stream: str, keys: list[str], n: int) -> dict[int, int]:
    async with OrderedPublisher(nc, stream) as pub:
        for i in range(n):
            await pub.publish(keys[i % len(keys)], json.dumps({"i": i}).encode())
    return {p.partition: p.last_seq for p in pub.summary.partitions if p.last_seq}


async def _assignment(nc, stream: str) -> Assignment:
    store = await GroupStore.attach(nc, stream, "g")
    data, _ = await store.read_assignment()
    return Assignment.from_json(data)


def test_cordon_moves_only_the_cordoned_members_partitions_and_work_goes_on(nats_url, unique_name):
    seen: list[int] = []

    async def handler(msg):
        seen.append(json.loads(msg.data)["i"])

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=6))
        async with WorkerPool(nats_url, _cfg(unique_name), handler, size=3) as pool:
            await pool.wait_assigned(20)
            before = await _assignment(nc, unique_name)
            cordoned = await rebalance_group(nc, unique_name, "g", cordon=["w-3"], timeout=30)
            marks = await _publish(nc, unique_name, [f"k{i}" for i in range(30)], 300)
            await wait_drained(nc, unique_name, "g", marks=marks, timeout=30)
            lifted = await rebalance_group(nc, unique_name, "g", timeout=30)
        await nc.close()
        return before, cordoned, lifted

    before, cordoned, lifted = asyncio.run(go())
    assert "w-3" not in cordoned.owners.values()
    assert set(cordoned.moves) == set(before.partitions_of("w-3"))
    assert all(old == "w-3" for old, _ in cordoned.moves.values())
    assert sorted(set(seen)) == list(range(300))
    assert sorted(lifted.owners.values()).count("w-3") == 2  # balanced again: 2 each


def test_rebalance_by_measured_load_reduces_imbalance_and_then_stays_put(nats_url, unique_name):
    async def handler(msg):
        pass

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=8))
        # a skewed stream: three keys carry almost everything
        await _publish(
            nc,
            unique_name,
            ["hot-a"] * 40 + ["hot-b"] * 30 + ["hot-c"] * 20 + [f"cold{i}" for i in range(10)],
            2000,
        )
        rates = await partition_rates(nc, unique_name, window=600)
        async with WorkerPool(nats_url, _cfg(unique_name), handler, size=3) as pool:
            await pool.wait_assigned(20)
            result = await rebalance_group(nc, unique_name, "g", weights=rates, timeout=30)
            await asyncio.sleep(1.0)  # several leader ticks: a fixed point moves nothing
            later = await _assignment(nc, unique_name)
        await nc.close()
        return rates, result, later

    rates, result, later = asyncio.run(go())
    assert sum(rates.values()) == pytest.approx(2000 / 600, rel=0.01)
    assert result.imbalance_after is not None and result.imbalance_before is not None
    assert result.imbalance_after <= result.imbalance_before
    assert later.generation == result.generation and later.owners == result.owners


def test_rebalance_without_running_members_says_so(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await GroupStore.open(nc, _cfg(unique_name).group_config)
        with pytest.raises(NatsOrderedError, match="are its workers running"):
            await rebalance_group(nc, unique_name, "g", timeout=1.0)
        await nc.close()

    asyncio.run(go())


def test_a_policy_the_leader_cannot_obey_is_reported_and_never_stops_the_group(
    nats_url, unique_name
):
    """Bad weights are refused before they are written; and a policy written behind the
    admin function's back (another version, a hand edit) is reported by the leader, which
    keeps the plain assignment instead of crashing every member in turn."""
    from airflow_nats_ordered.core.admin.membership import live_members
    from airflow_nats_ordered.core.errors import ConfigError
    from airflow_nats_ordered.core.group.assignment import RebalancePolicy

    async def handler(msg):
        pass

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with WorkerPool(nats_url, _cfg(unique_name), handler, size=2) as pool:
            await pool.wait_assigned(20)
            with pytest.raises(ConfigError, match="finite number >= 0"):
                await rebalance_group(nc, unique_name, "g", weights={0: -1.0}, timeout=5)
            with pytest.raises(ConfigError, match="cordon fewer members"):
                await rebalance_group(nc, unique_name, "g", cordon=["w-1", "w-2"], timeout=5)
            store = await GroupStore.attach(nc, unique_name, "g")
            _, rev = await store.read_policy()
            bad = RebalancePolicy(weights={0: float("inf")}, request="hand-edit")
            await store.write_policy(bad, rev)
            for _ in range(50):
                policy, _ = await store.read_policy()
                if policy.applied == "hand-edit":
                    break
                await asyncio.sleep(0.1)
            alive = await live_members(nc, unique_name, "g")
            for _ in range(30):  # the leader's next heartbeat carries its problem
                problems = (await store.snapshot()).problems
                if problems:
                    break
                await asyncio.sleep(0.1)
        await nc.close()
        return policy, alive, problems

    policy, alive, problems = asyncio.run(go())
    assert policy.applied == "hand-edit" and "not applied" in policy.error
    assert alive == ["w-1", "w-2"], "a bad policy stopped members"
    assert any("rebalance policy not applied" in p for p in problems)
