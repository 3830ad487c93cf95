"""A commit write that failed for a transient reason is sent again on its own
(core/worker/committer.py),
against a real server.

A partition that handled a burst and then goes idle submits nothing more, so a write of its
last position that failed (a server restart or a state-bucket leader election at the end of
the burst: no answer, no responders) must not wait for the next message to be retried: until
it lands, the group's record lags behind what was handled, so ``drain`` (and an Airflow drain
sensor) waits for its timeout on a group that is done, and a SIGKILL re-delivers everything
handled since the last write the server accepted, however long the partition was idle.
The failure here is a real refusal of the server: the state bucket's stream is made to refuse
the record (``max_msg_size``) and then set back, as an operator would fix a misconfiguration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import nats

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.committer import PartitionCommitter


async def _max_msg_size(js, stream: str, size: int) -> None:
    config = (await js.stream_info(stream)).config
    config.max_msg_size = size
    await js.update_stream(config)


async def _committer(nc, stream: str) -> tuple[GroupStore, PartitionCommitter, str]:
    """Partition 0 of a new one-partition stream granted to member "a", its committer (which
    only asks whether the lease is still valid locally), and the state bucket's stream."""
    await provision(nc, StreamSpec(stream, partitions=1))
    cfg = GroupConfig(stream, "g", lease_ttl=30.0)
    store = await GroupStore.open(nc, cfg)
    g = await store.grant(0, "a")
    c = PartitionCommitter(store, g, Lease("p.0", "a", 1, time.monotonic() + 300), "a")
    return store, c, f"KV_{cfg.state_bucket}"


def test_a_failed_write_is_sent_again_without_a_newer_position(shared_nats_server, unique_name):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        js = nc.jetstream()
        store, c, state_stream = await _committer(nc, unique_name)
        await c.submit(5, None, 5)
        await c.wait_answered(60)
        await _max_msg_size(js, state_stream, 16)  # the server refuses every commit record
        await c.submit(10, None, 10)  # the last position of the burst: refused
        await c.wait_answered(60)
        refused = (c.committed_count, c.busy)
        await _max_msg_size(js, state_stream, -1)  # the blip is over; nothing more submitted
        deadline = time.monotonic() + 60
        while c.committed_count < 10 and time.monotonic() < deadline:
            await c.wait_answered(0.2)
            await asyncio.sleep(0.05)
        rec = json.loads((await store.state.get("c.0")).value)
        c.cancel()
        await nc.close()
        return refused, c, rec

    refused, c, rec = asyncio.run(go())
    assert refused == (5, False), f"the refused write was not refused: {refused}"
    assert rec["seq"] == 10, f"the record stayed at {rec['seq']} after the server took writes again"
    assert c.committed_count == 10 and c.fenced is None


def test_an_outage_is_one_warning_not_one_per_commit_point(shared_nats_server, unique_name, caplog):
    """A synchronous handler's partition commits every few milliseconds: while the server
    refuses (a state-bucket leader election answers "no responders" for seconds), every
    failed write logged a warning. One warning per outage, and an info once it works again."""
    caplog.set_level(logging.INFO, logger="airflow_nats_ordered.core.worker.worker")

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        js = nc.jetstream()
        _, c, state_stream = await _committer(nc, unique_name)
        await _max_msg_size(js, state_stream, 16)
        for seq in range(1, 21):  # 20 commit points during the outage, each refused
            await c.submit(seq, None, seq)
            await c.wait_answered(60)
        await _max_msg_size(js, state_stream, -1)
        await c.submit(21, None, 21)
        await c.wait_answered(60)
        c.cancel()
        await nc.close()
        return c

    c = asyncio.run(go())
    mine = [r for r in caplog.records if "committing partition 0" in r.getMessage()]
    warnings = [r.getMessage() for r in mine if r.levelno == logging.WARNING]
    assert len(warnings) == 1, f"{len(warnings)} warnings for one outage: {warnings[:3]}"
    assert "at 1 failed" in warnings[0] and "message size exceeds" in warnings[0]
    infos = [r.getMessage() for r in mine if r.levelno == logging.INFO]
    # (20 or more failed writes: the retry timer may have sent one meanwhile on a slow run)
    assert len(infos) == 1 and "committing partition 0 works again (at 21, after" in infos[0]
    assert c.committed_count == 21
