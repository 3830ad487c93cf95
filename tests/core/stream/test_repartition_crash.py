"""A repartition killed at any step is completed by the next run (issue 28 item 3).

``nats-ordered repartition --stream S --partitions 8`` is SIGKILLed at each of its named
steps (:data:`~airflow_nats_ordered.core.stream.repartition.CRASH_POINTS`, through the testing
hook :data:`~airflow_nats_ordered.core.stream.repartition.CRASH_ENV`), while a publisher
publishes and two workers apply every record through the reference fenced sink. The next
run completes it: the stream ends exactly as after an uninterrupted run (subjects,
partition count, epoch, the old layout with its exact switch point), every record
published before, during and after is applied once and in per-key order, and no partition
is blocked (no false "stored state went back" on the new layout).

``test_a_repartition_left_after_its_first_update_is_completed`` starts from the state the
earlier version left when killed right after its first stream update (as users measured
it: layouts ``[{"epoch":0,"partitions":4,"switch_seq":0}]``), with workers running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.stream.layout import GROUP_EPOCH_KEY, META_EPOCH, META_LAYOUTS
from airflow_nats_ordered.core.stream.partitioned import (
    META_PARTITIONS,
    StreamSpec,
    describe,
    provision,
    stream_contents,
)
from airflow_nats_ordered.core.stream.repartition import lock_bucket
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

#: the testing hook and the steps of a run (``core.repartition.CRASH_ENV``, ``CRASH_POINTS``)
CRASH_ENV = "NATS_ORDERED_REPARTITION_CRASH_AT"
CRASH_POINTS = ("locked", "subjects-switched", "switch-read", "switch-recorded")
KEYS = 8
ROUNDS = 30
GROUP = "g"


class SinkHandler:
    """Applies every record through the reference fenced sink (one row per record)."""

    def __init__(self, path: Path, stream: str) -> None:
        with sqlite3.connect(path) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, k TEXT, i INTEGER, "
                "subject TEXT, seq INTEGER)"
            )
        self.sink = FencedSqliteSink(str(path), stream=stream, group=GROUP)

    def __call__(self, msg) -> None:
        d = json.loads(msg.data)

        def write(conn) -> None:
            conn.execute(
                "INSERT INTO events (k, i, subject, seq) VALUES (?, ?, ?, ?)",
                (msg.key, d["i"], msg.subject, msg.stream_seq),
            )

        self.sink.apply(msg.partition, msg.fencing_token, msg.stream_seq, write)

    def events(self) -> list[tuple[str, int, str, int]]:
        return self.sink.read(
            lambda conn: conn.execute(
                "SELECT k, i, subject, seq FROM events ORDER BY id"
            ).fetchall()
        )


def _cli(url: str, stream: str, crash_at: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "airflow_nats_ordered.cli",
            "repartition",
            "--stream",
            stream,
            "--partitions",
            "8",
            "--json",
            "--server",
            url,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


async def _until(cond, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g}s"
        await asyncio.sleep(0.2)


async def _publisher(nc, stream: str, gates: list[tuple[asyncio.Event, asyncio.Event]]) -> None:
    """Rounds of one record per key; a round refused by the switch goes again (same
    msg-ids). At each third it sets the gate's first event and waits for its second: a
    third is published before the interrupted run, one while it is unfinished, one after
    the run that completes it."""
    cfg = PublisherConfig(ack_timeout=1.0, delivery_timeout=1.0)
    for r in range(ROUNDS):
        if r and r % (ROUNDS // 3) == 0:
            reached, go_on = gates[r // (ROUNDS // 3) - 1]
            reached.set()
            await go_on.wait()
        deadline = time.monotonic() + 120
        while True:
            try:
                async with OrderedPublisher(nc, stream, config=cfg) as pub:
                    for k in range(KEYS):
                        body = json.dumps({"i": r}).encode()
                        await pub.publish(f"k{k}", body, msg_id=f"k{k}-{r}")
                break
            except PublishError:
                assert time.monotonic() < deadline, "a round was refused for 120 s"
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.02)


async def _exact_layout(nc, stream: str) -> dict[str, str]:
    """The metadata an uninterrupted 4 -> 8 run leaves: the old layout's switch point is the
    sequence of its last record (checked against the records themselves)."""
    s = await describe(nc, stream)
    old = await stream_contents(nc, s.at_epoch(0))
    last_old = max(p.last_seq for p in old.partitions)
    new = await stream_contents(nc, s)
    firsts = [p.last_seq - p.messages + 1 for p in new.partitions if p.messages]
    assert not firsts or min(firsts) > last_old
    return {
        META_PARTITIONS: "8",
        META_EPOCH: "1",
        META_LAYOUTS: json.dumps(
            [{"epoch": 0, "partitions": 4, "switch_seq": last_old}], separators=(",", ":")
        ),
    }


def _check_applied(handler: SinkHandler, workers: list[Worker]) -> None:
    events = handler.events()
    per_key: dict[str, list[int]] = {}
    for k, i, _subject, _seq in events:
        per_key.setdefault(k, []).append(i)
    for k in range(KEYS):
        assert per_key.get(f"k{k}") == list(range(ROUNDS)), (f"k{k}", per_key.get(f"k{k}"))
    assert len(events) == ROUNDS * KEYS  # each once
    # both layouts were applied, the old one entirely before the new one
    old = [n for n, e in enumerate(events) if ".e1-" not in e[2]]
    new = [n for n, e in enumerate(events) if ".e1-" in e[2]]
    assert old and new and max(old) < min(new)
    for w in workers:
        assert w.stats["stopped"] == 0, (w.member, w.problems)
        assert not any("went back" in p for p in w.problems.values()), w.problems


async def _scenario(url: str, stream: str, tmp: Path, interrupt) -> dict:
    """Workers and a publisher run; ``interrupt(nc)`` leaves the repartition unfinished at
    the half of the rounds; then the second run completes it. Returns what was seen."""
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
    handler = SinkHandler(tmp / "sink.db", stream)
    workers = [
        Worker(
            nc,
            WorkerConfig(stream, GROUP, member_id=m, lease_ttl=2.0),
            handler,
            on_assign=handler.sink.fence,
            fencing_floor=handler.sink.fencing_floor,
            applied_position=handler.sink.applied_position,
        )
        for m in ("w1", "w2")
    ]
    for w in workers:
        await w.start()
    gates = [(asyncio.Event(), asyncio.Event()), (asyncio.Event(), asyncio.Event())]
    publishing = asyncio.ensure_future(_publisher(nc, stream, gates))
    seen: dict = {}
    try:
        await gates[0][0].wait()
        # the workers applied part of the old layout: their sink holds old positions
        await _until(lambda: _async(len(handler.events()) >= KEYS), "first records applied")
        seen["after_kill"] = await interrupt(nc, workers)
        gates[0][1].set()  # records published while the repartition is unfinished
        await gates[1][0].wait()
        rerun = await asyncio.to_thread(_cli, url, stream, None)
        assert rerun.returncode == 0, rerun.stderr
        seen["rerun"] = json.loads(rerun.stdout)
        seen["rerun_progress"] = rerun.stderr
        gates[1][1].set()  # and after it
        await publishing

        async def all_applied() -> bool:
            return len(handler.events()) >= ROUNDS * KEYS

        await _until(all_applied, "every record applied")
        await asyncio.sleep(1.0)  # nothing more is applied (twice)
        _check_applied(handler, workers)
        kv = await nc.jetstream().key_value(f"nor_{stream}_{GROUP}_state")
        assert json.loads((await kv.get(GROUP_EPOCH_KEY)).value)["epoch"] == 1
        s = await describe(nc, stream)
        assert s.explicit_subjects and s.subjects_text == f"{s.prefix}.p.e1-0 to {s.prefix}.p.e1-7"
        want = await _exact_layout(nc, stream)
        got = {k: v for k, v in (s.config.metadata or {}).items() if k in want}
        assert got == want
        seen["switch_seq"] = s.layouts[0].switch_seq
        # the lock is released
        lock = await nc.jetstream().key_value(lock_bucket(stream))
        with pytest.raises(Exception):  # noqa: B017, PT011 - KeyNotFound or KeyDeleted
            await lock.get("lock")
    finally:
        for _, go_on in gates:
            go_on.set()
        publishing.cancel()
        for w in workers:
            await w.stop()
        await nc.close()
    return seen


async def _async(value):
    return value


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_a_repartition_killed_at_any_step_is_completed_by_the_next_run(
    shared_nats_server, unique_name, tmp_path, crash_at
):
    url, stream = shared_nats_server.url, unique_name

    async def kill_at_step(nc, _workers) -> dict:
        run = await asyncio.to_thread(_cli, url, stream, crash_at)
        assert run.returncode == -signal.SIGKILL, (run.returncode, run.stdout, run.stderr)
        s = await describe(nc, stream)
        return {
            "epoch": s.epoch,
            "pending": [lay.pending for lay in s.layouts],
            "switch": [lay.switch_seq for lay in s.layouts],
        }

    seen = asyncio.run(_scenario(url, stream, tmp_path, kill_at_step))
    print(crash_at, seen)
    after, rerun = seen["after_kill"], seen["rerun"]
    expected = {
        "locked": ({"epoch": 0, "pending": [], "switch": []}, "repartitioned"),
        "subjects-switched": ({"epoch": 1, "pending": [True], "switch": [0]}, "completed"),
        "switch-read": ({"epoch": 1, "pending": [True], "switch": [0]}, "completed"),
        "switch-recorded": (
            {"epoch": 1, "pending": [False], "switch": [seen["switch_seq"]]},
            "unchanged",
        ),
    }[crash_at]
    assert after == expected[0]
    assert rerun["action"] == expected[1], seen["rerun_progress"]
    assert (rerun["previous_partitions"], rerun["partitions"], rerun["epoch"]) == (4, 8, 1)
    assert rerun["switch_seq"] == seen["switch_seq"]


def test_a_repartition_left_after_its_first_update_is_completed(
    shared_nats_server, unique_name, tmp_path
):
    url, stream = shared_nats_server.url, unique_name

    async def first_update_only(nc, workers) -> dict:
        # what the earlier version's first update wrote before it was killed
        info = await nc.jetstream().stream_info(stream)
        cfg = info.config
        prefix = cfg.metadata["nats-ordered.prefix"]
        cfg.subjects = [f"{prefix}.p.e1-{n}" for n in range(8)]
        cfg.metadata = {
            **cfg.metadata,
            META_PARTITIONS: "8",
            META_EPOCH: "1",
            META_LAYOUTS: '[{"epoch":0,"partitions":4,"switch_seq":0}]',
        }
        await nc.jetstream().update_stream(cfg)
        # the workers see the new epoch meanwhile: they must not move onto it yet, and say
        # what completes it

        async def told() -> bool:
            said = [p for w in workers for p in w.problems.values()]
            return any("has not recorded the switch point" in p for p in said)

        await _until(told, "the members report the pending switch point")
        said = " ".join(p for w in workers for p in w.problems.values())
        assert f"nats-ordered repartition --stream {stream} --partitions 8" in said
        return {}

    seen = asyncio.run(_scenario(url, stream, tmp_path, first_update_only))
    assert seen["rerun"]["action"] == "completed", seen["rerun_progress"]
    assert "completing the interrupted repartition" in seen["rerun_progress"]


def test_the_crash_points_are_the_modules():
    from airflow_nats_ordered.core.stream import repartition

    assert (repartition.CRASH_ENV, repartition.CRASH_POINTS) == (CRASH_ENV, CRASH_POINTS)


def test_a_group_moved_past_a_switch_point_recorded_too_low_is_not_blocked(
    shared_nats_server, unique_name, tmp_path
):
    """The earlier version could record a switch point below old-layout records (item 4),
    or none, and let the group move on. The sink's positions of the old layout above that
    point are still not taken for the new partitions' (no false 'state went back')."""
    url, stream = shared_nats_server.url, unique_name

    async def main() -> None:
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        handler = SinkHandler(tmp_path / "sink.db", stream)

        def worker(m: str) -> Worker:
            return Worker(
                nc,
                WorkerConfig(stream, GROUP, member_id=m, lease_ttl=2.0),
                handler,
                on_assign=handler.sink.fence,
                fencing_floor=handler.sink.fencing_floor,
                applied_position=handler.sink.applied_position,
            )

        async def publish(rounds: range) -> None:
            async with OrderedPublisher(nc, stream) as pub:
                for r in rounds:
                    for k in range(KEYS):
                        await pub.publish(f"k{k}", json.dumps({"i": r}).encode(), msg_id=f"{k}-{r}")

        old = worker("w1")
        await old.start()
        await publish(range(10))
        await _until(lambda: _async(len(handler.events()) == 10 * KEYS), "old layout applied")
        await old.stop()
        # what the earlier version could leave: the switch point far below the old
        # layout's last record (80), and the group already on the new epoch
        info = await nc.jetstream().stream_info(stream)
        cfg = info.config
        prefix = cfg.metadata["nats-ordered.prefix"]
        cfg.subjects = [f"{prefix}.p.e1-{n}" for n in range(8)]
        cfg.metadata = {
            **cfg.metadata,
            META_PARTITIONS: "8",
            META_EPOCH: "1",
            META_LAYOUTS: '[{"epoch":0,"partitions":4,"switch_seq":10}]',
        }
        await nc.jetstream().update_stream(cfg)
        kv = await nc.jetstream().key_value(f"nor_{stream}_{GROUP}_state")
        await kv.put(GROUP_EPOCH_KEY, b'{"epoch":1,"from":0}')
        await publish(range(10, 20))
        new = worker("w2")
        await new.start()
        try:
            try:
                await _until(
                    lambda: _async(len(handler.events()) >= 20 * KEYS or new.stats["stopped"] > 0),
                    "new layout applied",
                )
            finally:
                assert new.stats["stopped"] == 0, new.problems
            per_key: dict[str, list[int]] = {}
            for k, i, _s, _q in handler.events():
                per_key.setdefault(k, []).append(i)
            assert all(v == list(range(20)) for v in per_key.values()), per_key
            assert new.stats["stopped"] == 0, new.problems
        finally:
            await new.stop()
            await nc.close()

    asyncio.run(main())
