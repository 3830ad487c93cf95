"""The server's stored state goes back (simulated on one real server: stop it, copy its store,
run on, stop, restore the copy, start it again, as a coordinated power loss inside the fsync
interval does to a cluster). New records then reuse sequences that the group or the sink
already passed. A member must notice, stop the partition (no handler call, no commit, no
dead letter) and say so with a blocked marker; after the documented operator action (reset
the group's position, rewind the sink) every new record is applied."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import time
from pathlib import Path

import nats
import pytest

from airflow_nats_ordered.core.admin.dlq import dead_letters
from airflow_nats_ordered.core.admin.reset import reset_group
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.sink.fencing import Verdict
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

STREAM, GROUP = "ROLLBACK", "g"


class SinkHandler:
    """Applies ``{"i": n}`` records to a FencedSqliteSink (table ``applied``)."""

    def __init__(self, path: Path, *, with_msg_id: bool) -> None:
        self.path, self.with_msg_id = path, with_msg_id
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE IF NOT EXISTS applied (i INTEGER)")
        self.sink = FencedSqliteSink(path, stream=STREAM, group=GROUP)
        self.calls: list[int] = []

    def on_assign(self, partition: int, token: int) -> None:
        self.sink.fence(partition, token)

    def fencing_floor(self, partition: int) -> int:
        return self.sink.fencing_floor(partition)

    def applied_position(self, partition: int):
        return self.sink.applied_position(partition)

    def __call__(self, msg) -> None:
        i = json.loads(msg.data)["i"]
        self.calls.append(i)
        msg_id = msg.headers.get("Nats-Msg-Id") if self.with_msg_id else None
        verdict = self.sink.apply(
            msg.partition,
            msg.fencing_token,
            msg.stream_seq,
            lambda conn: conn.execute("INSERT INTO applied (i) VALUES (?)", (i,)),
            msg_id=msg_id,
        )
        if verdict is Verdict.STALE_TOKEN:
            raise Fenced(f"token {msg.fencing_token} is stale")

    def applied(self) -> list[int]:
        with sqlite3.connect(self.path) as db:
            return [r[0] for r in db.execute("SELECT i FROM applied ORDER BY rowid")]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, msg) -> None:
        self.calls.append(json.loads(msg.data)["i"])


def _cfg(member: str) -> WorkerConfig:
    return WorkerConfig(
        STREAM, GROUP, member_id=member, lease_ttl=2.0, commit_interval=0.1, retry_backoff=0.05
    )


async def _publish(url: str, values) -> None:
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(STREAM, partitions=1))
    async with OrderedPublisher(nc, STREAM) as pub:
        for i in values:
            await pub.publish("k", json.dumps({"i": i}).encode())
    await nc.close()


async def _until(cond, timeout: float = 45.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.1)
    return False


async def _process(url: str, handler, member: str, committed: int) -> None:
    """Run a member until the group has committed ``committed`` on partition 0."""
    nc = await nats.connect(url)
    w = Worker(nc, _cfg(member), handler)
    await w.start()

    async def done() -> bool:
        rec, _ = await w.store.read_commit(0)
        return rec is not None and rec.seq >= committed

    assert await _until(done), f"not committed up to {committed}"
    await w.stop()
    await nc.close()


async def _after_rollback(url: str, handler, member: str):
    """Run a member on the rolled-back server until it reports something or has passed the
    new records; return what it did and the group's state as `status` reads it."""
    nc = await nats.connect(url)
    w = Worker(nc, _cfg(member), handler)
    await w.start()

    async def settled() -> bool:
        rec, _ = await w.store.read_commit(0)
        return (
            any(o.blocked for o in w.owned.values())
            or w.stats["dead_lettered"] > 0
            or (rec is not None and rec.seq >= 20 and rec.member == member)
        )

    await _until(settled)
    await asyncio.sleep(1.0)  # whatever it would do next, it does now
    snap = await w.store.snapshot()
    dead = await dead_letters(nc, STREAM, GROUP)
    stats, problems = dict(w.stats), list(w.problems.values())
    await w.stop()
    await nc.close()
    return snap, dead.messages, stats, problems


async def _reset(url: str, seq: int) -> None:
    nc = await nats.connect(url)
    await reset_group(nc, STREAM, GROUP, to={0: seq}, confirm=True)
    await nc.close()


async def _until_handled(url: str, handler, member: str, values: list[int]) -> None:
    nc = await nats.connect(url)
    w = Worker(nc, _cfg(member), handler)
    await w.start()

    async def done() -> bool:
        return all(v in handler.calls for v in values)

    ok = await _until(done)
    await w.stop()
    await nc.close()
    assert ok, f"not handled after the reset: {sorted(set(values) - set(handler.calls))}"


def _restore(server, copy: Path, only: str | None = None) -> None:
    """Stop ``server`` and put its store (or only stream ``only``'s directory) back."""
    server.stop()
    root = server.jetstream_dir
    if only is not None:
        root = root / "jetstream" / "$G" / "streams" / only
        copy = copy / "jetstream" / "$G" / "streams" / only
    shutil.rmtree(root)
    shutil.copytree(copy, root)
    server.start()


@pytest.mark.parametrize("with_msg_id", [True, False], ids=["msg-id", "no-msg-id"])
def test_a_sink_ahead_of_a_rolled_back_stream_stops_the_partition_until_reset(
    nats_server, tmp_path, with_msg_id
):
    """The whole store goes back (stream and group state): the group's position is
    consistent again, but the sink applied records 11-20 that the stream no longer has, and
    new records take their sequences. Before the fix: dead-lettered after sink refusals
    (msg_id given) or judged DUPLICATE and acknowledged, never applied (no msg_id)."""
    url = nats_server.url
    handler = SinkHandler(tmp_path / "sink.db", with_msg_id=with_msg_id)
    asyncio.run(_publish(url, range(10)))
    asyncio.run(_process(url, handler, "a", 10))
    nats_server.stop()
    copy = tmp_path / "copy"
    shutil.copytree(nats_server.jetstream_dir, copy)
    nats_server.start()
    asyncio.run(_publish(url, range(10, 20)))
    asyncio.run(_process(url, handler, "b", 20))
    assert handler.applied() == list(range(20))

    _restore(nats_server, copy)
    new = list(range(100, 110))  # stored at sequences 11-20 again
    asyncio.run(_publish(url, new))
    before = len(handler.calls)
    snap, dead, stats, problems = asyncio.run(_after_rollback(url, handler, "c"))

    assert dead == 0 and stats["dead_lettered"] == 0, "new records were dead-lettered"
    assert handler.calls[before:] == [], "the handler was called for the new records"
    assert handler.applied() == list(range(20))
    assert list(snap.blocked) == [0], f"partition 0 not stopped and reported: {snap.blocked}"
    reason = snap.blocked[0]
    assert "stored state went back" in reason and "sink" in reason, reason
    assert "reset" in reason and "rewind" in reason, reason  # the operator action
    assert any("stored state went back" in p for p in problems)
    assert any("stored state went back" in p for p in snap.problems)  # status shows it

    # the documented operator action: rewind the sink and the group to the last position
    # both agree is in the stream's history (seq 10), then every new record is applied
    handler.sink.rewind({0: 10})
    asyncio.run(_reset(url, 10))
    asyncio.run(_until_handled(url, handler, "d", new))
    assert handler.applied() == list(range(20)) + new
    with nats_server_store(url) as snap_after:
        assert snap_after.blocked == {}


class nats_server_store:  # noqa: N801 - a small sync context for one snapshot
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self):
        async def read():
            nc = await nats.connect(self.url)
            store = await GroupStore.attach(nc, STREAM, GROUP)
            snap = await store.snapshot()
            await nc.close()
            return snap

        return asyncio.run(read())

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_commit_record_ahead_of_a_rolled_back_stream_stops_the_partition(nats_server, tmp_path):
    """Only the stream goes back; the group's commit record (another stream, synced later)
    keeps its position at seq 20. New records fill sequences 11-20 again: resuming after 20
    would skip them all in silence (no sink to notice: a plain handler)."""
    url = nats_server.url
    handler = Recorder()
    asyncio.run(_publish(url, range(10)))
    asyncio.run(_process(url, handler, "a", 10))
    nats_server.stop()
    copy = tmp_path / "copy"
    shutil.copytree(nats_server.jetstream_dir, copy)
    nats_server.start()
    asyncio.run(_publish(url, range(10, 20)))
    asyncio.run(_process(url, handler, "b", 20))

    _restore(nats_server, copy, only=STREAM)
    new = list(range(100, 110))
    asyncio.run(_publish(url, new))
    snap, dead, stats, _ = asyncio.run(_after_rollback(url, handler, "c"))

    assert [i for i in handler.calls if i >= 100] == []
    assert list(snap.blocked) == [0], f"partition 0 not stopped and reported: {snap.blocked}"
    reason = snap.blocked[0]
    assert "stored state went back" in reason and "commit record" in reason, reason

    asyncio.run(_reset(url, 10))
    asyncio.run(_until_handled(url, handler, "d", new))
    assert [i for i in handler.calls if i >= 100] == new


def test_a_running_member_stops_when_the_state_goes_back_under_it(nats_server, tmp_path):
    """The member keeps running (and keeps its lease) while the server is stopped, its store
    restored and started again: its reader, re-creating its consumer, finds that the last
    message it handed out is no longer in the stream, and the partition stops. The handler
    passes no msg_id to the sink (the sink records the delivered message's id itself)."""
    url = nats_server.url
    handler = SinkHandler(tmp_path / "sink.db", with_msg_id=False)
    copy = tmp_path / "copy"
    new = list(range(100, 110))

    async def go():
        await _publish(url, range(10))
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        cfg = WorkerConfig(STREAM, GROUP, member_id="w", lease_ttl=30.0, commit_interval=0.1)
        w = Worker(nc, cfg, handler)
        await w.start()

        async def committed(seq: int) -> bool:
            rec, _ = await w.store.read_commit(0)
            return rec is not None and rec.seq >= seq

        assert await _until(lambda: committed(10))
        await asyncio.to_thread(nats_server.stop)
        await asyncio.to_thread(shutil.copytree, nats_server.jetstream_dir, copy)
        await asyncio.to_thread(nats_server.start)
        await _publish(url, range(10, 20))
        assert await _until(lambda: committed(20))
        await asyncio.to_thread(_restore, nats_server, copy)
        await _publish(url, new)  # sequences 11-20 again

        async def stopped() -> bool:
            return any(o.blocked for o in w.owned.values()) or w.stats["dead_lettered"] > 0

        await _until(stopped)
        await asyncio.sleep(1.0)
        reason = next((o.blocked for o in w.owned.values() if o.blocked), None)
        dead = w.stats["dead_lettered"]
        calls = list(handler.calls)

        # the operator action; the same member then resumes with the first new record
        handler.sink.rewind({0: 10})
        admin = await nats.connect(url)
        await reset_group(admin, STREAM, GROUP, to={0: 10}, confirm=True)
        await admin.close()

        async def all_new() -> bool:
            return all(v in handler.calls for v in new)

        resumed = await _until(all_new)
        await w.stop()
        await nc.close()
        return reason, dead, calls, resumed

    reason, dead, calls, resumed = asyncio.run(go())
    assert dead == 0
    assert [i for i in calls if i >= 100] == [], "the handler was called for the new records"
    assert reason is not None and "stored state went back" in reason, reason
    assert resumed, "the new records were not applied after the reset"
    assert handler.applied() == list(range(20)) + new


def test_a_message_the_sink_can_neither_apply_nor_skip_stops_the_partition(
    nats_url, unique_name, tmp_path
):
    """A sink refusal (SinkOrderError: another message was applied under this sequence) is
    not a poison message: it is neither retried nor dead-lettered; the partition stops and
    says why (before the fix: dead-lettered after the retries)."""
    sink = FencedSqliteSink(tmp_path / "s.db", stream=unique_name, group=GROUP)
    sink.apply(0, 1, 5, msg_id="from-another-history")
    calls: list[int] = []

    def handler(msg):  # a plain function: no applied_position hook, the sink refuses
        calls.append(msg.stream_seq)
        sink.apply(0, msg.fencing_token, msg.stream_seq, msg_id=msg.headers["Nats-Msg-Id"])

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(3):
                await pub.publish("k", json.dumps({"i": i}).encode())
        cfg = WorkerConfig(unique_name, GROUP, member_id="m", lease_ttl=2.0, retry_backoff=0.01)
        w = Worker(nc, cfg, handler)
        await w.start()
        await _until(_async(lambda: any(o.blocked for o in w.owned.values())))
        snap = await w.store.snapshot()
        await w.stop()
        await nc.close()
        return snap, w.stats

    snap, stats = asyncio.run(go())
    assert calls == [1] and stats["dead_lettered"] == 0 and stats["retries"] == 0
    assert "can neither apply nor skip it (SinkOrderError" in snap.blocked[0], snap.blocked


def _async(cond):
    async def check() -> bool:
        return cond()

    return check
