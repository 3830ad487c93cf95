"""The worker in-process against a real server: order, groups, rebalancing, poison."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import defaultdict

import nats
import pytest

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.reader import PartitionReader
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR
from airflow_nats_ordered.core.worker.worker import Worker


async def _setup(url, stream, n, keys=50, partitions=8):
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=partitions))
    await _publish(nc, stream, 0, n, keys)
    return nc


async def _publish(nc, stream, start, n, keys):
    async with OrderedPublisher(nc, stream) as pub:
        for g in range(start, start + n):
            k = f"k{g % keys}"
            await pub.publish(k, json.dumps({"k": k, "i": g // keys}).encode())


class Recorder:
    def __init__(self):
        self.seen = defaultdict(list)
        self.meta = []

    def __call__(self, msg):
        d = json.loads(msg.data)
        assert d["k"] == msg.key
        self.seen[msg.key].append(d["i"])
        self.meta.append((msg.partition, msg.fencing_token, msg.stream_seq))

    @property
    def count(self):
        return sum(len(v) for v in self.seen.values())


async def _until(cond, timeout=60.0):  # a bound on a hang: a loaded machine is slow
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def _assert_in_order_at_least_once(rec):
    for key, v in rec.seen.items():
        _check_replays(v, key)


def _check_replays(v, key="k"):
    """``v`` (one key's values, published as 0, 1, 2, ...) is what an in-order,
    at-least-once consumer may see: nothing lost, and every re-delivery a contiguous replay
    of an already delivered suffix (it restarts at some earlier point and goes on from
    there, each value the next one, until it passes what had been delivered before)."""
    distinct = sorted(set(v))
    assert distinct == list(range(len(distinct))), f"{key}: values lost: {v}"
    high = -1  # the highest value delivered so far
    for i, x in enumerate(v):
        prev = v[i - 1] if i else -1
        if x == prev + 1:
            high = max(high, x)
            continue  # the next one, in a first delivery or in a replay
        # a restart: allowed only to an earlier point, and only once the previous run
        # (a replay, if one was going on) had caught up with everything delivered before
        assert x <= high, f"{key}: skipped ahead to {x} after {prev} in {v}"
        assert prev == high, f"{key}: replay left at {prev} before reaching {high} in {v}"


def _cfg(stream, group="g", member="m1", **kw):
    return WorkerConfig(stream, group, member_id=member, lease_ttl=kw.pop("lease_ttl", 2.0), **kw)


def test_one_worker_processes_every_message_in_per_key_order(shared_nats_server, unique_name):
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 5000)
        w = Worker(nc, _cfg(unique_name), rec)
        await w.start()
        await _until(lambda: rec.count >= 5000)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert rec.count == 5000
    for v in rec.seen.values():
        assert v == list(range(len(v)))  # in order, no gaps, no duplicates
    tokens = defaultdict(set)
    for p, t, _ in rec.meta:
        tokens[p].add(t)
    assert all(len(t) == 1 for t in tokens.values())  # one grant per partition
    by_part = defaultdict(list)
    for p, _, seq in rec.meta:
        by_part[p].append(seq)
    assert all(s == sorted(s) for s in by_part.values())


def test_each_group_sees_every_message(shared_nats_server, unique_name):
    a, b = Recorder(), Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 2000)
        wa = Worker(nc, _cfg(unique_name, group="ga"), a)
        wb = Worker(nc, _cfg(unique_name, group="gb"), b)
        await wa.start()
        await wb.start()
        await _until(lambda: a.count >= 2000 and b.count >= 2000)
        await wa.stop()
        await wb.stop()
        await nc.close()

    asyncio.run(go())
    # every message, in key order (a lease lost on a loaded machine may replay a few: at
    # least once, never a gap)
    for rec in (a, b):
        assert {k: sorted(set(v)) for k, v in rec.seen.items()} == {
            f"k{k}": list(range(2000 // 50)) for k in range(50)
        }
        _assert_in_order_at_least_once(rec)


def test_join_moves_only_the_new_members_share_and_leave_hands_over_at_once(
    shared_nats_server, unique_name
):
    """Cooperative: on a join only the partitions that move are revoked; a graceful leave
    hands over without waiting for the (long) lease TTL."""
    rec = Recorder()
    revoked = defaultdict(list)

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 3000, partitions=12)
        ttl = 20.0  # a TTL wait would blow the timeouts below
        w1 = Worker(
            nc,
            _cfg(unique_name, member="m1", lease_ttl=ttl),
            rec,
            on_revoke=lambda p: revoked["m1"].append(p),
        )
        await w1.start()
        await _until(lambda: len(w1.owned) == 12)
        w2 = Worker(nc, _cfg(unique_name, member="m2", lease_ttl=ttl), rec)
        await w2.start()
        await _until(lambda: len(w2.owned) == 6 and len(w1.owned) == 6)
        moved = set(w2.owned)
        t0 = time.monotonic()
        await w2.stop()
        await _until(lambda: len(w1.owned) == 12)
        handover = time.monotonic() - t0
        await _publish(nc, unique_name, 3000, 600, 50)
        await _until(lambda: rec.count >= 3600)
        await w1.stop()
        await nc.close()
        return moved, handover

    moved, handover = asyncio.run(go())
    assert set(revoked["m1"][:6]) == moved  # only the moved partitions were revoked on join
    assert handover < 5  # no TTL (20 s) wait
    # graceful hand-overs commit first: every key exactly once, in order
    for v in rec.seen.values():
        assert v == list(range(len(v)))


def test_restart_resumes_from_the_committed_position(shared_nats_server, unique_name):
    first, second = Recorder(), Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 1000)
        w = Worker(nc, _cfg(unique_name), first)
        await w.start()
        await _until(lambda: first.count >= 1000)
        await w.stop()
        await _publish(nc, unique_name, 1000, 500, 50)
        w = Worker(nc, _cfg(unique_name, member="m2"), second)
        await w.start()
        await _until(lambda: second.count >= 500)
        await asyncio.sleep(0.3)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert first.count == 1000 and second.count == 500  # graceful stop committed everything
    assert min(min(v) for v in second.seen.values()) == 20
    # the second grant has a larger token
    assert min(t for _, t, _ in second.meta) > max(t for _, t, _ in first.meta)


def test_poison_message_is_dead_lettered_with_its_error_and_processing_moves_on(
    shared_nats_server, unique_name
):
    rec = Recorder()
    attempts = defaultdict(int)

    def handler(msg):
        d = json.loads(msg.data)
        if d["k"] == "k7" and d["i"] == 3:
            attempts[msg.stream_seq] += 1
            raise ValueError("cannot parse amount")
        rec(msg)

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 500)
        w = Worker(nc, _cfg(unique_name, max_retries=2, retry_backoff=0.01), handler)
        await w.start()
        await _until(lambda: rec.count >= 499)
        await w.stop()
        js = nc.jetstream()
        sub = await js.pull_subscribe(">", stream=f"{unique_name}_DLQ")
        dead = await sub.fetch(1, timeout=30)
        await nc.close()
        return dead, w.stats

    dead, stats = asyncio.run(go())
    assert list(attempts.values()) == [3]  # 1 try + 2 retries
    assert stats["dead_lettered"] == 1
    assert "ValueError: cannot parse amount" in dead[0].headers[HDR_ERROR]
    assert dead[0].headers["Nats-Ordered-Key"] == "k7"
    assert json.loads(dead[0].data) == {"k": "k7", "i": 3}
    assert rec.seen["k7"] == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # moved on, in order


def test_poison_block_policy_stops_the_partition_and_reports_why(shared_nats_server, unique_name):
    rec = Recorder()

    def handler(msg):
        if json.loads(msg.data) == {"k": "k7", "i": 3}:
            raise RuntimeError("downstream rejected")
        rec(msg)

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 500)
        w = Worker(
            nc, _cfg(unique_name, max_retries=1, retry_backoff=0.01, poison="block"), handler
        )
        await w.start()
        await _until(lambda: any(o.blocked for o in w.owned.values()))
        await asyncio.sleep(0.5)
        snap = await w.store.snapshot()
        await w.stop()
        await nc.close()
        return snap

    snap = asyncio.run(go())
    assert rec.seen["k7"] == [0, 1, 2]  # nothing after the poison message of that partition
    (reason,) = snap.blocked.values()
    assert "RuntimeError: downstream rejected" in reason and "after 2 attempts" in reason
    (blocked_partition,) = snap.blocked

    # the fix is deployed: a new member resumes exactly at the poison message (the blocked
    # member committed what it had done and released at stop), and the marker is cleared
    fixed = Recorder()

    async def resume():
        nc = await nats.connect(shared_nats_server.url)
        w = Worker(nc, _cfg(unique_name, member="m2", poison="block"), fixed)
        await w.start()
        await _until(lambda: rec.count + fixed.count >= 500)
        snap = await w.store.snapshot()
        await w.stop()
        await nc.close()
        return snap

    after = asyncio.run(resume())
    assert fixed.seen["k7"] == [3, 4, 5, 6, 7, 8, 9]
    assert rec.count + fixed.count == 500  # nothing re-delivered: stop committed
    assert {p for p, _, _ in fixed.meta} == {blocked_partition}
    assert after.blocked == {}


def test_worker_settings_are_validated():
    from airflow_nats_ordered.core.errors import ConfigError

    with pytest.raises(ConfigError, match="poison policy"):
        WorkerConfig("S", "g", poison="skip")
    with pytest.raises(ConfigError, match="member id"):
        WorkerConfig("S", "g", member_id="a.b")


def test_server_restart_under_a_running_worker_loses_nothing(nats_server, unique_name):
    """kill -9 the server while a worker processes, restart it on the same store, publish
    more: every message is processed, per key in order (re-deliveries of the uncommitted
    tail are allowed: at-least-once)."""
    rec = Recorder()

    async def go():
        nc = await nats.connect(nats_server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        await _publish(nc, unique_name, 0, 3000, 30)
        w = Worker(nc, _cfg(unique_name, lease_ttl=3.0, commit_every=100), rec)
        await w.start()
        await _until(lambda: rec.count >= 500)
        nats_server.kill()
        await asyncio.sleep(0.5)
        await asyncio.to_thread(nats_server.restart)
        await _publish(nc, unique_name, 3000, 1000, 30)
        await _until(
            lambda: len({(k, i) for k, v in rec.seen.items() for i in v}) >= 4000, timeout=60
        )
        await w.stop()
        await nc.close()

    asyncio.run(go())
    _assert_in_order_at_least_once(rec)


def test_a_claim_whose_lease_lapses_during_on_assign_never_processes(
    shared_nats_server, unique_name
):
    """on_assign that outlives the lease (here: it blocks the event loop past the TTL, as a
    paused process would) must not start processing under that grant: the claim is given
    up and the partition is claimed afresh with a newer token."""
    rec = Recorder()
    blocked = []

    def on_assign(p, token):
        if not blocked:
            blocked.append((p, token))
            time.sleep(1.6)  # the whole event loop stalls: no renewal can be sent

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 500, partitions=1)
        w = Worker(nc, _cfg(unique_name, lease_ttl=1.0), rec, on_assign=on_assign)
        await w.start()
        await _until(lambda: rec.count >= 500)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    ((p, lapsed),) = blocked
    used = {t for _, t, _ in rec.meta}
    assert p == 0 and len(used) == 1 and min(used) > lapsed  # the lapsed grant was never used
    for v in rec.seen.values():
        assert v == list(range(len(v)))


def test_a_partition_cancelled_again_during_its_clean_up_is_claimed_again(
    nats_server, unique_name, monkeypatch
):
    """A partition task interrupted a second time while cleaning up (its server calls hang)
    must still leave `owned`; otherwise this member would never claim it again."""
    rec = Recorder()
    close = PartitionReader.close

    async def close_with_a_server_call(self, wait=True):
        # the reader's own clean-up makes no server call (its consumer ends by itself): one
        # that hangs while the server is paused stands for any clean-up call that does
        await close(self, wait)
        with contextlib.suppress(Exception):
            await self.nc.request(f"$JS.API.STREAM.INFO.{self.stream}", b"", timeout=1.0)

    monkeypatch.setattr(PartitionReader, "close", close_with_a_server_call)

    async def go():
        nc = await _setup(nats_server.url, unique_name, 200, partitions=1)
        w = Worker(nc, _cfg(unique_name, lease_ttl=1.0), rec)
        await w.start()
        await _until(lambda: rec.count >= 200)
        task = w.owned[0].task
        nats_server.pause()  # the clean-up's server call now hangs
        try:
            task.cancel()
            await asyncio.sleep(0.3)
            assert not task.done()
            task.cancel()
            await asyncio.sleep(0.1)
        finally:
            nats_server.resume()
        await _until(lambda: task.done())
        await _publish(nc, unique_name, 200, 200, 50)
        await _until(lambda: rec.count >= 400)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert len({t for _, t, _ in rec.meta}) == 2  # claimed again: a second, larger token
    _assert_in_order_at_least_once(rec)


def test_worker_pool_shares_partitions_joins_and_leaves(shared_nats_server, unique_name):
    """The in-process pool: members on their own connections share the partitions; add()
    joins, remove() leaves gracefully; everything is processed once per group, in order,
    and stop() leaves no lease behind."""
    from airflow_nats_ordered.core.group.store import GroupStore
    from airflow_nats_ordered.core.worker.pool import WorkerPool

    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 3000, partitions=8)
        cfg = _cfg(unique_name, member="pool", commit_interval=0.2)
        async with WorkerPool(shared_nats_server.url, cfg, rec, size=2) as pool:
            assert pool.members == ["pool-1", "pool-2"]
            await _until(lambda: rec.count >= 3000)
            await _until(lambda: all(len(w.owned) == 4 for w in pool.workers))
            joined = await pool.add()
            await _until(lambda: len(joined.owned) >= 2)
            await _publish(nc, unique_name, 3000, 2000, 50)
            await pool.remove("pool-1")
            assert pool.members == ["pool-2", "pool-3"]
            await _until(lambda: rec.count >= 5000)
            await _until(lambda: sum(len(w.owned) for w in pool.workers) == 8)
            processed = pool.stats["processed"]
        store = await GroupStore.open(nc, cfg.group_config)
        snap = await store.snapshot()
        await nc.close()
        return processed, snap

    processed, snap = asyncio.run(go())
    assert rec.count == 5000  # graceful leaves commit: nothing re-delivered
    for v in rec.seen.values():
        assert v == list(range(len(v)))
    assert processed == 5000
    assert snap.leases == {} and snap.members == {} and snap.leader is None, snap
    assert sorted(snap.commits) == list(range(8))


def test_worker_pool_refuses_bad_sizes_and_unknown_members(unique_name):
    from airflow_nats_ordered.core.errors import ConfigError
    from airflow_nats_ordered.core.worker.pool import WorkerPool

    with pytest.raises(ConfigError, match="pool size"):
        WorkerPool("nats://127.0.0.1:4222", _cfg(unique_name), print, size=-1)
    pool = WorkerPool("nats://127.0.0.1:4222", _cfg(unique_name), print)
    with pytest.raises(ConfigError, match="no members"):
        asyncio.run(pool.remove())


def drop_deliveries(monkeypatch, numbers):
    """Make every partition reader lose the deliveries with these 1-based numbers (counted
    over all readers, status messages excluded) as a reconnect or a slow-consumer cut-off
    would; returns {"n": deliveries seen, "dropped": deliveries lost}."""
    real_on_msg = PartitionReader._on_msg
    seen = {"n": 0, "dropped": 0}

    async def lossy_on_msg(self, m):
        if not (m.headers and m.headers.get("Status")):
            seen["n"] += 1
            if seen["n"] in numbers:
                seen["dropped"] += 1
                return
        await real_on_msg(self, m)

    monkeypatch.setattr(PartitionReader, "_on_msg", lossy_on_msg)
    return seen


def test_deliveries_lost_between_server_and_worker_are_read_again(
    shared_nats_server, unique_name, monkeypatch
):
    """Ack-none consumers never re-send: a delivery lost on the way (a reconnect, a slow
    consumer cut-off) must be noticed from the consumer sequence and read again, in order."""
    seen = drop_deliveries(monkeypatch, (700, 2_500))
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 4000, keys=1, partitions=1)
        w = Worker(nc, _cfg(unique_name, fetch_batch=100), rec)
        await w.start()
        await _until(lambda: rec.count >= 4000)
        await asyncio.sleep(0.3)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert seen["dropped"] == 2
    assert rec.seen["k0"] == list(range(4000))  # nothing skipped, nothing twice


def test_a_lost_last_delivery_is_read_again_without_waiting_for_new_messages(
    shared_nats_server, unique_name, monkeypatch, caplog
):
    """When the *last* delivery of a partition is lost, no later delivery reveals the gap:
    the idle heartbeats of the pending pull requests (which name the last consumer
    sequence sent) must, with nothing new published."""
    seen = drop_deliveries(monkeypatch, (50,))
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 50, keys=1, partitions=1)
        w = Worker(nc, _cfg(unique_name), rec)
        await w.start()
        await _until(lambda: rec.count >= 50, timeout=60)  # a bound on a hang, not a speed
        await w.stop()
        await nc.close()

    with caplog.at_level(logging.WARNING, logger="airflow_nats_ordered"):
        asyncio.run(go())
    assert seen["dropped"] == 1
    assert rec.seen["k0"] == list(range(50))
    # noticed by a heartbeat naming the last consumer sequence sent (the status-100 path),
    # not by a later delivery (there is none) nor by the reader's silence fallback
    assert any("deliveries 50..50 lost on the wire" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


def test_a_cancelled_stop_still_stops_the_member(shared_nats_server, unique_name):
    """stop() under a timeout that fires mid-hand-over: the member must still end (its
    loops and partition tasks finish, `stopped` is set) rather than linger half-alive."""
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 200, partitions=4)
        w = Worker(nc, _cfg(unique_name), rec)
        await w.start()
        await _until(lambda: rec.count >= 200 and len(w.owned) == 4)
        partition_tasks = [o.task for o in w.owned.values()]
        stopping = asyncio.ensure_future(w.stop())
        await asyncio.sleep(0.01)
        stopping.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
        assert w.stopped.is_set()
        await asyncio.sleep(0.5)
        alive = [t for t in w._tasks + partition_tasks if not t.done()]
        await nc.close()
        return alive

    assert asyncio.run(go()) == []


def test_the_order_checker_accepts_only_contiguous_replays_of_a_delivered_suffix():
    """The checker the tests above rely on: a jump back that does not replay contiguously
    up to what was delivered before (``[0, 1, 2, 3, 1, 4]`` skips 2 and 3 of its replay)
    is a reorder, not a re-delivery."""
    for ok in ([0, 1, 2, 3], [0, 1, 2, 3, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 1, 2, 3], [0, 0, 1]):
        _check_replays(ok)
    for bad in ([0, 1, 2, 3, 1, 4], [0, 2, 1], [0, 1, 2, 3, 2, 4, 3], [0, 1, 3, 2], [1, 0]):
        with pytest.raises(AssertionError):
            _check_replays(bad)
