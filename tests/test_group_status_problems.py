"""What ``status`` calls a problem (core.group_status), against a real nats-server."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.core.group import GroupStore
from airflow_nats_ordered.core.streams import StreamSpec, provision
from airflow_nats_ordered.core.worker import WorkerConfig


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
            return await store._deleted_commit_problems({}), (await store.snapshot()).problems
        finally:
            await nc.close()

    listed_late, snapshot = asyncio.run(go())
    assert [p.split(":")[0] for p in listed_late] == ["partition 1"], listed_late
    assert [p for p in snapshot if "was deleted" in p] == listed_late
