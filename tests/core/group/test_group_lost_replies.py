"""A lost reply is not fencing (issue 7 item 10), against a real server.

A lost reply is reproduced exactly: the member's own write is applied by the server through
a copy of its grant or lease (as if the reply never came back), so the member's cached
revision is stale while the record holds what it wrote.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import nats
import pytest

from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.leases import LeaseLost
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


async def _store(url, name, ttl=2.0):
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(name, partitions=2))
    return nc, await GroupStore.open(nc, GroupConfig(name, "g", lease_ttl=ttl))


def test_a_commit_applied_whose_reply_was_lost_is_adopted_not_fenced(
    shared_nats_server, unique_name
):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        g = await store.grant(0, "a")
        await store.commit(g, 5)
        await store.commit(replace(g), 10)  # applied; the member never saw the reply
        await store.commit(g, 10)  # the member retries the same commit: not fenced
        adopted = g.revision
        await store.commit(g, 12)  # and goes on committing with the adopted revision
        rec = json.loads((await store.state.get("c.0")).value)
        await nc.close()
        return g, adopted, rec

    g, adopted, rec = asyncio.run(go())
    assert g.committed == 12 and g.revision > adopted
    assert rec["seq"] == 12 and rec["token"] == g.token and rec["member"] == "a"


def test_a_later_commit_after_a_lost_reply_is_written(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        g = await store.grant(0, "a")
        await store.commit(replace(g), 10)  # applied; reply lost (the worker logs and goes on)
        await store.commit(g, 20)  # the next commit point, with the stale revision
        rec = json.loads((await store.state.get("c.0")).value)
        await nc.close()
        return g, rec

    g, rec = asyncio.run(go())
    assert g.committed == 20 and rec["seq"] == 20 and rec["token"] == g.token


def test_a_really_fenced_owner_is_still_fenced_after_a_lost_reply(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        old = await store.grant(0, "zombie")
        await store.commit(replace(old), 10)  # the zombie's last commit: reply lost
        new = await store.grant(0, "new")
        with pytest.raises(Fenced, match="fenced off by a newer owner"):
            await store.commit(old, 20)
        rec = json.loads((await store.state.get("c.0")).value)
        await nc.close()
        return new, rec

    new, rec = asyncio.run(go())
    assert (rec["seq"], rec["token"], rec["member"]) == (10, new.token, "new")


def test_a_renewal_applied_whose_reply_was_lost_keeps_the_lease(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        a = await store.acquire("p.0", "a")
        await store.renew(replace(a))  # applied; the member never saw the reply
        await store.renew(a)  # not LeaseLost: the key still holds a's claim
        taken = await store.acquire("p.0", "b")
        await store.renew(a)
        await nc.close()
        return a, taken

    a, taken = asyncio.run(go())
    assert a.valid and taken is None


def test_a_lease_taken_over_is_still_lost(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        a = await store.acquire("p.0", "a")
        await store.release(replace(a))  # e.g. an operator, or a's own release retried
        b = await store.acquire("p.0", "b")
        with pytest.raises(LeaseLost):
            await store.renew(a)
        assert b is not None
        await store.renew(b)
        await nc.close()

    asyncio.run(go())


def test_release_after_a_lost_renewal_reply_frees_the_lease_at_once(
    shared_nats_server, unique_name
):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=30.0)
        a = await store.acquire("p.0", "a")
        await store.renew(replace(a))  # applied; reply lost: a's revision is stale
        await store.release(a)
        b = await store.acquire("p.0", "b")  # no 30 s wait for the TTL
        await nc.close()
        return b

    assert asyncio.run(go()) is not None
