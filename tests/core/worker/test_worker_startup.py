"""How a member starts (issue 19 item 2): its claims, and the handler hooks around them.

A member that starts alone claims every partition of the group's first assignment. It
used to claim them one after another, each a few round trips (lease, token), and once the
first partitions were processing, each further claim's round trips waited behind their
slices of handler work: the last of 16 partitions began 1.2-1.9 s into a 2.5 s read of a
100k-record backlog. Without handler hooks the claims now run at once; ``on_assign`` and
``fencing_floor`` (a sink's code) are still called one partition at a time, as before.
"""

from __future__ import annotations

import asyncio

import nats

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

PARTITIONS = 8


def _count_partition_claims(monkeypatch) -> dict[str, int]:
    """Count partition-lease claims in flight (now, and the most at any time)."""
    real_acquire = GroupStore.acquire
    seen = {"now": 0, "most": 0, "claims": 0}

    async def acquire(self, key, member):
        if key == "leader":
            return await real_acquire(self, key, member)
        seen["now"] += 1
        seen["claims"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            return await real_acquire(self, key, member)
        finally:
            seen["now"] -= 1

    monkeypatch.setattr(GroupStore, "acquire", acquire)
    return seen


def test_a_member_without_hooks_claims_its_partitions_at_once(
    shared_nats_server, unique_name, monkeypatch
):
    seen = _count_partition_claims(monkeypatch)

    async def go() -> set[int]:
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=PARTITIONS))
        w = Worker(nc, WorkerConfig(unique_name, "g", member_id="m1"), lambda msg: None)
        await w.start()
        try:
            await w.wait_assigned(60)
            return w.claimed
        finally:
            await w.stop()
            await nc.close()

    claimed = asyncio.run(go())
    assert claimed == set(range(PARTITIONS))
    assert seen["claims"] == PARTITIONS
    assert seen["most"] == PARTITIONS, seen  # one after another: at most 1 in flight


def test_on_assign_and_fencing_floor_are_still_called_one_partition_at_a_time(
    shared_nats_server, unique_name, monkeypatch
):
    seen = _count_partition_claims(monkeypatch)
    hooks = {"now": 0, "most": 0, "assigned": [], "floors": []}

    async def hook(kind: str, p: int) -> None:
        hooks["now"] += 1
        hooks["most"] = max(hooks["most"], hooks["now"])
        await asyncio.sleep(0.01)  # a sink's round trip: another claim could run meanwhile
        hooks[kind].append(p)
        hooks["now"] -= 1

    async def on_assign(p: int, token: int) -> None:
        await hook("assigned", p)

    async def fencing_floor(p: int) -> int:
        await hook("floors", p)
        return 0

    async def go() -> None:
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=PARTITIONS))
        w = Worker(
            nc,
            WorkerConfig(unique_name, "g", member_id="m1"),
            lambda msg: None,
            on_assign=on_assign,
            fencing_floor=fencing_floor,
        )
        await w.start()
        try:
            await w.wait_assigned(60)
        finally:
            await w.stop()
            await nc.close()

    asyncio.run(go())
    assert sorted(hooks["assigned"]) == list(range(PARTITIONS))
    assert sorted(hooks["floors"]) == list(range(PARTITIONS))
    assert hooks["most"] == 1 and seen["most"] == 1, (hooks, seen)
