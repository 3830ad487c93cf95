"""What a member does when the group's lease bucket forgot it (issue 19 item 3).

When the server leading the lease bucket dies, no key can be written until a new leader is
elected (seconds), so every key ages out meanwhile, the leader member's own included. The
leader must not then decide an assignment over the members it can list (none, or a few
that happened to come back first): that hands every partition to nobody, revokes them all
and claims them again once the members' heartbeats are stored. The member keys are deleted
here the way the server's max age removes them."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker


async def _until(cond, timeout=60.0):  # a bound on a hang: a loaded machine is slow
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


def test_a_leader_whose_own_member_key_aged_out_keeps_the_assignment(
    shared_nats_server, unique_name, tmp_path
):
    audit = tmp_path / "audit.jsonl"

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        cfg = WorkerConfig(unique_name, "g", member_id="m1", lease_ttl=4.0, audit_log=str(audit))
        w = Worker(nc, cfg, lambda m: None)
        await w.start()
        await w.wait_assigned(60)
        leases = await nc.jetstream().key_value(GroupConfig(unique_name, "g").lease_bucket)
        rounds = 0
        live_members = w.leader.live_members

        async def counted():
            nonlocal rounds
            rounds += 1
            return await live_members()

        w.leader.live_members = counted  # counts the leader's rounds (the real listing runs)
        await leases.delete("m.m1")  # aged out, as during the bucket's leader election
        back = False

        async def watch_key():
            nonlocal back, rounds
            while True:
                try:
                    await leases.get("m.m1")
                    if not back:
                        back, rounds = True, 0
                    return
                except Exception:
                    await asyncio.sleep(0.02)

        await asyncio.wait_for(watch_key(), 60)
        await _until(lambda: rounds >= 3)
        claimed, stats = w.claimed, dict(w.stats)
        await w.stop()
        await nc.close()
        return claimed, stats

    claimed, stats = asyncio.run(go())
    assignments = [
        e for e in map(json.loads, audit.read_text().splitlines()) if e["kind"] == "assignment"
    ]
    assert [a["members"] for a in assignments] == [["m1"]], (
        f"the leader wrote assignments {assignments} (one, to m1, expected)"
    )
    assert stats["rebalances"] == 1 and claimed == {0, 1, 2, 3}, (stats, claimed)
