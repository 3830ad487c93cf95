"""A partition's commit writes (core/worker/committer.py, core/group/cas_writes.py), against a real
server
(issue 19 item 4).

A write is sent from ``submit()`` and its answer handled in the background, so what
``GroupStore.commit`` checks inline happens there: a newer owner's token fences the writer,
and the reply of an applied write that never came back is adopted (the record holds this
grant's own token), not taken for fencing. And the write is on the server before the
caller's event loop turns: a synchronous handler holding the loop afterwards (or a SIGKILL
then) does not keep it from landing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace

import nats

from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.committer import PartitionCommitter


async def _store(url, name):
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(name, partitions=1))
    return nc, await GroupStore.open(nc, GroupConfig(name, "g", lease_ttl=30.0))


def _lease(member: str) -> Lease:
    # the committer only asks whether the lease is still valid locally
    return Lease("p.0", member, 1, time.monotonic() + 60)


async def _record(store):
    return json.loads((await store.state.get("c.0")).value)


def test_a_submitted_write_reaches_the_server_while_the_loop_is_held(
    shared_nats_server, unique_name
):
    url = shared_nats_server.url

    def read_from_another_connection(out: dict) -> None:
        async def read():
            nc = await nats.connect(url)
            kv = await nc.jetstream().key_value(GroupConfig(unique_name, "g").state_bucket)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                out["seq"] = json.loads((await kv.get("c.0")).value)["seq"]
                if out["seq"] == 40:
                    break
                await asyncio.sleep(0.02)
            await nc.close()

        asyncio.run(read())

    async def go():
        nc, store = await _store(url, unique_name)
        g = await store.grant(0, "a")
        c = PartitionCommitter(store, g, _lease("a"), "a")
        await c.submit(40, None, 40)
        # hold the loop (as a synchronous handler does): nothing of this process runs
        seen: dict = {}
        t = threading.Thread(target=read_from_another_connection, args=(seen,))
        t.start()
        t.join()
        await c.wait_answered(10)
        await nc.close()
        return seen, c

    seen, c = asyncio.run(go())
    assert seen.get("seq") == 40, f"the record held {seen} while the loop was held"
    assert c.committed_count == 40 and c.fenced is None


def test_a_lost_reply_is_adopted_and_the_next_write_goes_through(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        g = await store.grant(0, "a")
        c = PartitionCommitter(store, g, _lease("a"), "a")
        await c.submit(5, None, 5)
        await c.wait_answered(10)
        await store.commit(replace(g), 10)  # applied; the committer never saw the reply
        await c.submit(12, None, 12)  # on its stale revision: refused, checked, sent again
        await c.wait_answered(10)
        rec = await _record(store)
        await nc.close()
        return g, c, rec

    g, c, rec = asyncio.run(go())
    assert c.fenced is None
    assert (rec["seq"], rec["token"], rec["member"]) == (12, g.token, "a")
    assert c.committed_count == 12 and g.committed == 12


def test_a_newer_owner_fences_the_pipelined_write(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        g = await store.grant(0, "a")
        c = PartitionCommitter(store, g, _lease("a"), "a")
        await c.submit(5, None, 5)
        await c.wait_answered(10)
        newer = await store.grant(0, "b")
        await c.submit(9, None, 9)
        await c.wait_answered(10)
        await c.submit(11, None, 11)  # nothing more is sent once fenced
        rec = await _record(store)
        await nc.close()
        return newer, c, rec

    newer, c, rec = asyncio.run(go())
    assert isinstance(c.fenced, Fenced)
    assert (rec["seq"], rec["token"], rec["member"]) == (5, newer.token, "b")
    assert c.committed_count == 5
