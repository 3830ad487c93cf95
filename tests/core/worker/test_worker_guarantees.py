"""The worker's guarantees from issue 7, against a real server: fenced partitions move at
once, repeated failures back off and show in the status, on_revoke(p) ends before the
next on_assign(p), a failing batch dead-letters only what failed, the reader's memory is
bounded in bytes, and a member can be awaited until it has claimed its assignment."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from test_worker import Recorder, _cfg, _publish, _setup, _until

from airflow_nats_ordered.core.errors import BatchFailed, ConfigError
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.reader import PartitionReader
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR
from airflow_nats_ordered.core.worker.pool import WorkerPool
from airflow_nats_ordered.core.worker.worker import Worker


async def _dead_letters(nc, stream, expect):
    """The dead-letter stream's messages: at least ``expect`` (waited for up to 60 s, a
    bound on a hang), and any more."""
    sub = await nc.jetstream().pull_subscribe(">", stream=f"{stream}_DLQ")
    got = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            got += await sub.fetch(10, timeout=0.5)
        except TimeoutError:  # nats-py raises its own subclass, or plain asyncio.TimeoutError
            if len(got) >= expect:
                break
    return got


# -- 10: fenced -----------------------------------------------------------------------------------


def test_a_fenced_partition_is_released_at_once_not_after_a_ttl(shared_nats_server, unique_name):
    """A commit refused because a newer grant exists stops the partition without committing,
    and gives back the lease it still holds, so the partition is claimed again (with a newer
    token) at once rather than when the lease expires."""
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 100, keys=1, partitions=1)
        cfg = _cfg(unique_name, lease_ttl=6.0, commit_interval=0.1)
        w = Worker(nc, cfg, rec)
        await w.start()
        await _until(lambda: rec.count >= 100)
        first = w.owned[0].grant.token
        intruder = await (await GroupStore.open(nc, cfg.group_config)).grant(0, "intruder")
        await _publish(nc, unique_name, 100, 10, 1)  # the next commit meets the newer token
        t0 = time.monotonic()
        await _until(lambda: 0 in w.owned and w.owned[0].grant.token > intruder.token, 60)
        moved = time.monotonic() - t0
        await _until(lambda: rec.count >= 110)
        await w.stop()
        await nc.close()
        return first, intruder.token, moved, w.stats

    first, intruder, moved, stats = asyncio.run(go())
    assert first < intruder
    assert stats["fenced"] == 1
    assert moved < 2.0, f"claimed again after {moved:.1f}s (lease TTL 6 s)"
    # every message, in order; where the fenced owner stopped, the new owner re-delivers from
    # the last commit the fenced one made (how soon it noticed depends on its commit points)
    seen = rec.seen["k0"]
    assert list(dict.fromkeys(seen))[:110] == list(range(110)), seen
    assert all(b == a + 1 or b <= a for a, b in zip(seen, seen[1:], strict=False)), seen


# -- 11: backoff and problems ---------------------------------------------------------------------


def test_a_failing_on_assign_is_retried_with_backoff_and_reported(shared_nats_server, unique_name):
    """on_assign that keeps failing (the sink is down) must not bump the token and write to
    KV every tick: claims back off exponentially, and the member's heartbeat (so ``status``)
    carries the problem until a claim succeeds."""
    calls: list[tuple[float, int]] = []
    healthy = asyncio.Event()
    rec = Recorder()

    def on_assign(p, token):
        calls.append((time.monotonic(), token))
        if not healthy.is_set():
            raise ConnectionError("sink unavailable")

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 50, partitions=1)
        w = Worker(nc, _cfg(unique_name, lease_ttl=2.0), rec, on_assign=on_assign)
        await w.start()
        await asyncio.sleep(3.5)
        failing = len(calls)
        await asyncio.sleep(w.cfg.group_config.renew_interval + 0.2)  # a heartbeat
        snap = await w.store.snapshot()
        healthy.set()
        await _until(lambda: rec.count >= 50, timeout=60)
        await asyncio.sleep(w.cfg.group_config.renew_interval + 0.2)
        after = await w.store.snapshot()
        await w.stop()
        await nc.close()
        return failing, snap, after

    failing, snap, after = asyncio.run(go())
    assert 2 <= failing <= 6, f"{failing} on_assign calls in 3.5 s"  # not one per 0.1 s tick
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:failing], strict=False)]
    assert all(b > a * 1.5 for a, b in zip(gaps, gaps[1:], strict=False)), gaps
    assert any("on_assign failed: ConnectionError: sink unavailable" in p for p in snap.problems)
    assert after.problems == []


def test_a_dead_letter_stream_that_cannot_be_created_backs_off_and_holds_the_partition(
    shared_nats_server, unique_name
):
    """Poison message, dead-letter policy, and the dead-letter stream cannot be created
    (another stream owns part of its subjects): the member keeps the partition (no
    re-grant, no re-run of the handler's retries every tick), retries the dead-lettering
    with backoff, reports it, and moves on once the stream can be created."""
    attempts = []
    rec = Recorder()

    def handler(msg):
        if json.loads(msg.data) == {"k": "k0", "i": 3}:
            attempts.append(msg.fencing_token)
            raise ValueError("cannot parse amount")
        rec(msg)

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 20, keys=1, partitions=1)
        prefix = (await describe(nc, unique_name)).prefix
        js = nc.jetstream()
        blocker = f"{unique_name}_BLOCKER"
        await js.add_stream(name=blocker, subjects=[f"{prefix}.dlq.zzz"])
        w = Worker(nc, _cfg(unique_name, max_retries=1, retry_backoff=0.05), handler)
        await w.start()
        await asyncio.sleep(3.0)
        held = (len(attempts), rec.count, sorted(w.problems.values()))
        await js.delete_stream(blocker)
        await _until(lambda: rec.count >= 19, timeout=60)
        dead = await _dead_letters(nc, unique_name, 1)
        await w.stop()
        await nc.close()
        return held, dead, w.stats

    (n_attempts, count, problems), dead, stats = asyncio.run(go())
    assert n_attempts == 2  # 1 try + 1 retry, once: the partition was never given up
    assert len(set(attempts)) == 1  # ... nor granted again
    assert count == 3  # nothing after the poison message while it could not be dead-lettered
    assert any("dead-lettering seq 4 failed" in p for p in problems), problems
    assert [json.loads(d.data) for d in dead] == [{"k": "k0", "i": 3}]
    assert stats["dead_lettered"] == 1
    assert rec.seen["k0"] == [0, 1, 2] + list(range(4, 20))


# -- 12: on_revoke before the next on_assign -------------------------------------------------------


def test_on_assign_of_a_partition_waits_for_its_pending_on_revoke(shared_nats_server, unique_name):
    """An async handler class whose on_revoke takes a while: a partition given up (here:
    the sink says fenced) and claimed again by the same member must see on_assign only
    after on_revoke has finished, or the teardown would destroy the new state."""
    events: list[str] = []

    class Handler:
        def __init__(self):
            self.fenced_once = False

        async def __call__(self, msg):
            if not self.fenced_once:
                self.fenced_once = True
                raise Fenced("the sink saw a newer token")

        async def on_assign(self, p, token):
            events.append("assign")

        async def on_revoke(self, p):
            events.append("revoke-start")
            await asyncio.sleep(2.5)  # longer than the lease TTL: the lease is free before
            events.append("revoke-end")

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 10, partitions=1)
        h = Handler()
        cfg = _cfg(unique_name, lease_ttl=1.0)
        w = Worker(nc, cfg, h, on_assign=h.on_assign, on_revoke=h.on_revoke)
        await w.start()
        await _until(lambda: events.count("assign") >= 2, timeout=60)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert events[:4] == ["assign", "revoke-start", "revoke-end", "assign"], events


# -- 13: batches ----------------------------------------------------------------------------------


class _Sink:
    """Applies messages; refuses the poison one. ``partial``: reports how far it got with
    BatchFailed; otherwise all-or-nothing (a transaction: nothing of a failing batch)."""

    def __init__(self, partial: bool):
        self.partial = partial
        self.applied: list[int] = []
        self.calls = 0

    def __call__(self, msgs):
        self.calls += 1
        staged = []
        for i, m in enumerate(msgs):
            d = json.loads(m.data)
            if d == {"k": "k0", "i": 37}:
                if self.partial:
                    self.applied += staged
                    raise BatchFailed(applied=i, cause="amount is not a number")
                raise ValueError("amount is not a number")
            staged.append(d["i"])
        self.applied += staged


@pytest.mark.parametrize("partial", [True, False], ids=["BatchFailed", "all-or-nothing"])
def test_a_failing_batch_dead_letters_only_the_failing_message(
    shared_nats_server, unique_name, partial
):
    """Batch mode: a batch that fails at one message must dead-letter that message only,
    and apply every other message once, in order: resumed after what the handler reports
    applied (BatchFailed), or found one by one when the handler applies all or nothing."""
    sink = _Sink(partial)

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 100, keys=1, partitions=1)
        cfg = _cfg(unique_name, batch_handler=True, max_retries=2, retry_backoff=0.01)
        w = Worker(nc, cfg, sink)
        await w.start()
        await _until(lambda: len(sink.applied) >= 99)
        dead = await _dead_letters(nc, unique_name, 1)  # (the partition idles meanwhile)
        alive = w.owned[0].task is not None and not w.owned[0].task.done()
        await w.stop()
        await nc.close()
        return dead, w.stats, alive

    dead, stats, alive = asyncio.run(go())
    assert alive  # an idle partition in batch mode keeps running
    assert sink.applied == [i for i in range(100) if i != 37]  # each once, in order
    assert [json.loads(d.data) for d in dead] == [{"k": "k0", "i": 37}]
    assert "amount is not a number" in dead[0].headers[HDR_ERROR]
    assert stats["dead_lettered"] == 1 and stats["processed"] == 99


def test_batch_failed_refuses_a_negative_count():
    with pytest.raises(ValueError, match="applied"):
        BatchFailed(applied=-1)


# -- 14: memory bounded by bytes ------------------------------------------------------------------


def test_the_reader_holds_at_most_its_byte_share_and_still_reads_a_larger_message(
    shared_nats_server, unique_name, monkeypatch
):
    """With 20 KB messages and a 256 KiB budget, the bytes received but not yet handled stay
    within the budget (message counts alone would allow 2 x 500 messages, 20 MB), and a
    single message larger than the whole budget is still delivered, in order."""
    budget = 256 * 1024
    big = 400_000
    state = {"received": 0, "handled": 0, "peak": 0}
    real_on_msg = PartitionReader._on_msg

    async def counting_on_msg(self, m):
        if m.reply and not (m.headers and m.headers.get("Status")):
            state["received"] += len(m.data)
            state["peak"] = max(state["peak"], state["received"] - state["handled"])
        await real_on_msg(self, m)

    monkeypatch.setattr(PartitionReader, "_on_msg", counting_on_msg)
    order = []

    async def handler(msg):
        await asyncio.sleep(0.002)
        order.append(int(msg.headers["Nats-Ordered-Seq"]))
        state["handled"] += len(msg.data)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(120):
                await pub.publish("k", (b"%d:" % i).ljust(big if i == 60 else 20_000, b"x"))
        w = Worker(nc, _cfg(unique_name, max_buffer_bytes=budget), handler)
        await w.start()
        await _until(lambda: len(order) >= 120, timeout=60)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert order == list(range(1, 121))
    # the budget, or the one oversized message read alone (plus what the handler holds)
    assert state["peak"] <= big + 20_000, state
    assert state["received"] >= 120 * 20_000


# -- waiting for an assignment ------------------------------------------------------------------


def test_wait_assigned_returns_once_the_member_and_the_pool_have_claimed_their_partitions(
    shared_nats_server, unique_name
):
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 10, partitions=4)
        w = Worker(nc, _cfg(unique_name), rec)
        await w.start()
        await w.wait_assigned(timeout=60)
        alone = (set(w.claimed), set(w.assigned))
        await w.stop()
        cfg = _cfg(unique_name, group="pooled", member="pool")
        async with WorkerPool(shared_nats_server.url, cfg, rec, size=5) as pool:
            await pool.wait_assigned(timeout=60)
            claimed = [set(x.claimed) for x in pool.workers]
            idle = next(x for x in pool.workers if not x.assigned)
            with pytest.raises(TimeoutError, match="has not claimed its assignment"):
                await idle.wait_assigned(timeout=0.5)  # 5 members, 4 partitions
        await nc.close()
        return alone, claimed

    alone, claimed = asyncio.run(go())
    assert alone == ({0, 1, 2, 3}, {0, 1, 2, 3})
    assert sorted(p for c in claimed for p in c) == [0, 1, 2, 3]


# -- H2a's group settings -------------------------------------------------------------------------


def test_worker_config_passes_state_replicas_and_missing_commit_to_the_group():
    g = WorkerConfig("S", "g", state_replicas=3, missing_commit="earliest").group_config
    assert (g.replicas, g.missing_commit) == (3, "earliest")
    assert WorkerConfig("S", "g").group_config.replicas is None  # the stream's
    with pytest.raises(ConfigError, match="missing_commit"):
        WorkerConfig("S", "g", missing_commit="skip")
    with pytest.raises(ConfigError, match="max_buffer_bytes"):
        WorkerConfig("S", "g", max_buffer_bytes=10)


def test_the_sinks_fencing_floor_raises_the_token_of_the_grant(shared_nats_server, unique_name):
    """fencing_floor(p) (the highest token the sink has seen) is passed to the grant, so the
    new owner's token is above it even if the group's own records say less."""
    floor = int(time.time() * 1000) + 10_000_000
    asked = []
    rec = Recorder()

    async def fencing_floor(p):
        asked.append(p)
        return floor

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 10, partitions=2)
        w = Worker(nc, _cfg(unique_name), rec)  # the group's records exist
        await w.start()
        await w.wait_assigned(timeout=60)
        await w.stop()
        w = Worker(nc, _cfg(unique_name, member="m2"), rec, fencing_floor=fencing_floor)
        await w.start()
        await w.wait_assigned(timeout=60)
        tokens = {p: o.grant.token for p, o in w.owned.items()}
        await w.stop()
        await nc.close()
        return tokens

    tokens = asyncio.run(go())
    assert sorted(asked) == [0, 1]
    assert sorted(tokens) == [0, 1] and all(t > floor for t in tokens.values()), tokens


def test_a_missing_commit_record_backs_off_and_is_reported_not_hammered(
    shared_nats_server, unique_name
):
    """The sink has seen tokens for a partition the group has no record of (its state was
    re-created) and missing_commit is 'fail': the member must not retry the grant every
    tick; it backs off and reports what to do."""
    asked = []

    def fencing_floor(p):
        asked.append(time.monotonic())
        return 5

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 10, partitions=1)
        w = Worker(nc, _cfg(unique_name), Recorder(), fencing_floor=fencing_floor)
        await w.start()
        await asyncio.sleep(3.5)
        problems, claimed = sorted(w.problems.values()), set(w.claimed)
        await w.stop()
        await nc.close()
        return problems, claimed

    problems, claimed = asyncio.run(go())
    assert claimed == set()
    assert 2 <= len(asked) <= 6, f"{len(asked)} grant attempts in 3.5 s"
    assert any("missing_commit" in p and "retrying in" in p for p in problems), problems


def test_a_steady_reader_keeps_its_consumer(shared_nats_server, unique_name, monkeypatch):
    """Pull requests that ask for idle heartbeats end with an informational 409 "Batch
    Completed": that is the normal end of a request, and re-creating the consumer for it
    (once per batch) more than halved the throughput. One consumer reads the whole backlog."""
    opened = []
    real_open = PartitionReader._open

    async def counting_open(self):
        opened.append(self.next_seq)
        await real_open(self)

    monkeypatch.setattr(PartitionReader, "_open", counting_open)
    rec = Recorder()

    async def go():
        nc = await _setup(shared_nats_server.url, unique_name, 3000, keys=1, partitions=1)
        w = Worker(nc, _cfg(unique_name, fetch_batch=100), rec)
        await w.start()
        await _until(lambda: rec.count >= 3000)
        await w.stop()
        await nc.close()

    asyncio.run(go())
    assert rec.seen["k0"] == list(range(3000))
    assert opened == [1]
