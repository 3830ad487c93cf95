"""What ``status`` calls a problem (core.group_status), against a real nats-server."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.core.admin.membership import live_members
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig


def test_a_commit_record_written_after_the_key_listing_is_not_called_deleted(
    shared_nats_server, unique_name
):
    """A new group's members write their first commit records while ``status`` reads: a
    record missing from the snapshot's key listing but present now is not a deleted one
    (seen by hand: a fresh pool's status listed 'commit record c.13 was deleted' for
    records that had just been created). A record that was deleted still is."""

    async def go() -> tuple[list[str], list[str]]:
        nc = await nats.connect(shared_nats_server.url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            cfg = WorkerConfig(unique_name, "g", member_id="m").group_config
            await GroupStore.open(nc, cfg)
            store = await GroupStore.attach(nc, unique_name, "g")
            record = json.dumps({"seq": 0, "token": 1, "member": "m", "ts": 0.0}).encode()
            await store.state.put("c.0", record)
            await store.state.put("c.1", record)
            await store.state.delete("c.1")
            # as if the key listing ran before c.0 was written
            deleted = await store.snapshots._deleted_commit_problems({})
            return deleted, (await store.snapshot()).problems
        finally:
            await nc.close()

    listed_late, snapshot = asyncio.run(go())
    assert [p.split(":")[0] for p in listed_late] == ["partition 1"], listed_late
    assert [p for p in snapshot if "was deleted" in p] == listed_late


def test_status_and_live_members_see_every_key_while_the_buckets_are_written(
    shared_nats_server, unique_name
):
    """While members commit and heartbeat (a key of each bucket rewritten every
    millisecond), every snapshot still lists the blocked marker, the member and the lease,
    and every live-member read the member. nats-py's ``KeyValue.keys()`` returned no keys
    at all for a few percent of such reads (its end-of-listing marker raced the entries),
    so ``status`` and ``group list`` showed a blocked group as unblocked (seen in a loaded
    CI run) and ``group delete`` could find no live member."""
    reads = 300

    async def go() -> tuple[list[str], int]:
        nc = await nats.connect(shared_nats_server.url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            cfg = WorkerConfig(unique_name, "g", member_id="m").group_config
            await GroupStore.open(nc, cfg)
            store = await GroupStore.attach(nc, unique_name, "g")
            record = json.dumps({"seq": 0, "token": 1, "member": "m", "ts": 0.0}).encode()
            await store.state.put("c.0", record)
            await store.state.put("blocked.1", b"blocked at seq 2: poison")
            await store.leases.put("m.m", json.dumps({"partitions": [0, 1]}).encode())
            await store.leases.put("p.0", json.dumps({"member": "m"}).encode())
            stop = asyncio.Event()

            async def rewrite(kv, key: str, value: bytes) -> None:
                while not stop.is_set():
                    await kv.put(key, value)
                    await asyncio.sleep(0.001)

            writers = [
                asyncio.create_task(rewrite(store.state, "c.0", record)),
                asyncio.create_task(rewrite(store.state, "assignment", b"{}")),
                asyncio.create_task(rewrite(store.leases, "p.0", b'{"member":"m"}')),
                asyncio.create_task(rewrite(store.leases, "m.m", b'{"partitions":[0,1]}')),
            ]
            missed: list[str] = []
            members_missed = 0
            try:
                for i in range(reads):
                    snap = await store.snapshot()
                    if 1 not in snap.blocked or "m" not in snap.members or 0 not in snap.leases:
                        missed.append(
                            f"read {i}: blocked {sorted(snap.blocked)}, members "
                            f"{sorted(snap.members)}, leases {sorted(snap.leases)}"
                        )
                    if await live_members(nc, unique_name, "g") != ["m"]:
                        members_missed += 1
            finally:
                stop.set()
                await asyncio.gather(*writers)
            return missed, members_missed
        finally:
            await nc.close()

    missed, members_missed = asyncio.run(go())
    assert missed == [], f"{len(missed)} of {reads} snapshots missed keys: {missed[:3]}"
    assert members_missed == 0, f"{members_missed} of {reads} live-member reads saw none"
