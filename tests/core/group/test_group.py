"""Leases, fencing tokens and commits in the group's KV buckets, against a real server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import nats
import pytest

from airflow_nats_ordered.core.admin.membership import live_members
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.leases import LeaseLost
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


async def _store(url, name, ttl=1.0):
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(name, partitions=4))
    return nc, await GroupStore.open(nc, GroupConfig(name, "g", lease_ttl=ttl))


def test_only_one_member_can_hold_a_lease(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        a = await store.acquire("p.0", "a")
        b = await store.acquire("p.0", "b")
        await nc.close()
        return a, b

    a, b = asyncio.run(go())
    assert a is not None and a.valid and b is None


def test_lease_expiry_is_decided_by_the_server_after_the_ttl(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=1.0)
        a = await store.acquire("p.0", "a")
        t0 = time.monotonic()
        # not before the TTL: nobody can take it while the holder believes it valid
        while a.valid:
            assert await store.acquire("p.0", "b") is None
            await asyncio.sleep(0.05)
        b = None
        while b is None and time.monotonic() - t0 < 60:  # a bound on a hang, not a speed
            b = await store.acquire("p.0", "b")
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
        with pytest.raises(LeaseLost):
            await store.renew(a)
        await nc.close()
        return took, b

    took, b = asyncio.run(go())
    # taken after the TTL (1 s), never before it; how soon after is the server's timing
    assert b is not None and took > 0.9


def test_release_hands_a_lease_over_without_waiting_for_the_ttl(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=30.0)
        a = await store.acquire("p.0", "a")
        await store.release(a)
        b = await store.acquire("p.0", "b")
        await nc.close()
        return a, b

    a, b = asyncio.run(go())
    assert b is not None and not a.valid


def test_a_member_that_leaves_is_gone_even_if_its_last_heartbeat_reply_was_lost(
    shared_nats_server, unique_name
):
    """A heartbeat in flight when the member leaves is applied by the server, but its reply
    never reaches the member (the task was cancelled): the member's lease still names the
    revision before it. Leaving must delete the key all the same; before, the stale
    revision made the delete fail silently and the member that had left was listed as
    alive (``status``, drains) until its TTL ran out (seen in a loaded CI run)."""

    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=30.0)
        lease = await store.heartbeat("m1", None, {"pid": 1})
        in_flight = dataclasses.replace(lease)
        await store.heartbeat("m1", in_flight, {"pid": 1})  # applied; `lease` never hears
        assert in_flight.revision > lease.revision
        await store.release(lease)
        members = await live_members(nc, unique_name, "g")
        await nc.close()
        return members

    assert asyncio.run(go()) == []


def test_renewal_keeps_a_lease_past_its_ttl(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=1.0)
        a = await store.acquire("p.0", "a")
        for _ in range(8):
            await asyncio.sleep(0.25)
            await store.renew(a)
            assert await store.acquire("p.0", "b") is None
        await nc.close()

    asyncio.run(go())


def test_every_grant_has_a_larger_token_and_keeps_the_committed_position(
    shared_nats_server, unique_name
):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        g1 = await store.grant(3, "a")
        await store.commit(g1, 41)
        g2 = await store.grant(3, "b")
        g3 = await store.grant(3, "c")
        await nc.close()
        return g1, g2, g3

    g1, g2, g3 = asyncio.run(go())
    assert g1.token < g2.token < g3.token
    assert g2.committed == 41 and g3.committed == 41


def test_zombie_owner_cannot_commit_after_a_new_grant(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name)
        old = await store.grant(0, "zombie")
        await store.commit(old, 10)
        new = await store.grant(0, "new")
        with pytest.raises(Fenced, match="fenced off by a newer owner"):
            await store.commit(old, 20)
        await store.commit(new, 15)
        snap = await store.snapshot()
        await nc.close()
        return snap

    snap = asyncio.run(go())
    assert snap.commits[0].seq == 15 and snap.commits[0].member == "new"


def test_members_of_a_group_must_agree_on_the_lease_ttl(shared_nats_server, unique_name):
    async def go():
        nc, _ = await _store(shared_nats_server.url, unique_name, ttl=2.0)
        with pytest.raises(ConfigError, match=r"pass lease_ttl=2 \(CLI: --lease-ttl 2\)"):
            await GroupStore.open(nc, GroupConfig(unique_name, "g", lease_ttl=5.0))
        await nc.close()

    asyncio.run(go())


@pytest.mark.parametrize(
    "kw,match", [({"group": "a.b"}, "group name"), ({"lease_ttl": 0.1}, "lease TTL")]
)
def test_bad_group_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        GroupConfig(**({"stream": "S", "group": "g"} | kw))


def test_snapshot_reports_each_members_own_problems_with_its_id(shared_nats_server, unique_name):
    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=5.0)
        await store.heartbeat("m1", None, {"problems": ["partition 2: on_assign failed"]})
        await store.heartbeat("m2", None, {"problems": []})
        snap = await store.snapshot()
        await nc.close()
        return snap

    snap = asyncio.run(go())
    assert snap.problems == ["m1: partition 2: on_assign failed"]


def test_taking_a_lease_over_retries_when_a_renewal_lands_between_read_and_delete(
    shared_nats_server, unique_name, monkeypatch
):
    """reset/grant take a holder's lease by deleting it at the revision they read; a renewal
    landing in between makes the server refuse the delete (wrong last sequence), which
    nats-py raises as a plain BadRequestError from KeyValue.delete. It must be read again
    and retried, not fail the reset (seen in a loaded CI run: err_code=10071)."""
    from airflow_nats_ordered.core.group import leases as leases_mod

    real = leases_mod.latest_entry

    async def go():
        nc, store = await _store(shared_nats_server.url, unique_name, ttl=30.0)
        a = await store.acquire("p.0", "a")
        value, _ = await real(nc, store.cfg.lease_bucket, "p.0")
        claim = json.loads(value)["claim"]
        calls = 0

        async def renewal_in_between(*args):
            nonlocal calls
            calls += 1
            entry = await real(*args)
            if calls == 1:
                await store.renew(a)  # the holder renews after the read: its revision moves
            return entry

        monkeypatch.setattr(leases_mod, "latest_entry", renewal_in_between)
        await store.leasing.take_lease_from(0, claim)
        after = await real(nc, store.cfg.lease_bucket, "p.0")
        await nc.close()
        return calls, after

    calls, after = asyncio.run(go())
    assert calls == 2, "the refused delete was not read again"
    assert after is None or after[0] is None, f"the lease was not taken: {after}"
