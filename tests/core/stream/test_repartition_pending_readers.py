"""Readers of a stream whose repartition left its switch point pending (issue 28: where the
crash-safe repartition meets exact lag and the drain's marks).

A ``nats-ordered repartition`` SIGKILLed right after its first stream update
(``NATS_ORDERED_REPARTITION_CRASH_AT=subjects-switched``) leaves the new subjects with the
closed layout marked ``pending`` and switch point 0. No group moves past it, and until it
is recorded nobody knows which records are the closed layout's. So, with two workers
running and records published on both layouts: drain waits do not return (with the old
layout's marks, naming a partition the new layout lacks, they used to fail at once with a
ConfigError), and they end within their bounds saying the repartition is unfinished and
which command completes it; the lag is exact (the old layout's records left plus every
new-layout record) and never ``drained``; ``status`` shows the pending switch as a problem.
The re-run completes it, and the waits started before it return once everything is
applied, the lag 0."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import nats
import pytest
from airflow_dags import nats_connection

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.admin.drain import CHECK_EVERY, read_lag, wait_drained
from airflow_nats_ordered.core.admin.drain_errors import (
    DrainTimeoutError,
    RepartitionUnfinishedError,
)
from airflow_nats_ordered.core.admin.listing import GroupRef, summarize_group
from airflow_nats_ordered.core.admin.marks import DrainProgress
from airflow_nats_ordered.core.group.lag import GroupLag, PartitionLag
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

CRASH_ENV = "NATS_ORDERED_REPARTITION_CRASH_AT"
KEYS = 8
ROUNDS = 10
GROUP = "g"


def _repartition_cli(
    url: str, stream: str, crash_at: str | None, partitions: int = 3
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if crash_at:
        env[CRASH_ENV] = crash_at
    args = ["repartition", "--stream", stream, "--partitions", str(partitions)]
    args += ["--json", "--server", url]
    return subprocess.run(
        [sys.executable, "-m", "airflow_nats_ordered.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _cli_json(url: str, *args: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--json", "--server", url])
    return code, json.loads(out.getvalue())


def _status_json(url: str, stream: str) -> tuple[int, dict]:
    return _cli_json(url, "status", "--stream", stream, "--group", GROUP)


def _poke(stream: str, marks: dict[int, int] | None) -> bool:
    """One poke of the poke-mode drain sensor (marks: the stream's last sequences now)."""
    sensor = NatsGroupDrainSensor(
        task_id="poked",
        stream=stream,
        group=GROUP,
        nats_conn_id="nats_pending",
        high_water_marks=None if marks is None else {str(p): m for p, m in marks.items()},
        deferrable=False,
    )
    return bool(sensor.poke({}))


async def _publish(nc, stream: str, rounds: range) -> dict[int, int]:
    async with OrderedPublisher(nc, stream) as pub:
        for r in rounds:
            for k in range(KEYS):
                await pub.publish(f"k{k}", json.dumps({"i": r}).encode(), msg_id=f"k{k}-{r}")
    assert pub.summary is not None
    return pub.summary.high_water_marks


async def _two_workers(nc, stream: str, handler) -> list[Worker]:
    """A 4-partition stream and two running members of group ``g`` applying ``handler``."""
    await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
    workers = [
        Worker(nc, WorkerConfig(stream, GROUP, member_id=m, lease_ttl=2.0), handler)
        for m in ("w1", "w2")
    ]
    for w in workers:
        await w.start()
    return workers


async def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g}s"
        await asyncio.sleep(0.2)


def test_drain_lag_and_status_while_a_switch_point_is_pending_then_after_the_rerun(
    shared_nats_server, unique_name, monkeypatch
):
    url, stream = shared_nats_server.url, unique_name
    monkeypatch.setenv("AIRFLOW_CONN_NATS_PENDING", nats_connection(url))
    command = f"nats-ordered repartition --stream {stream} --partitions 3"
    applied: list[tuple[str, int]] = []

    def handler(msg) -> None:
        applied.append((msg.key, json.loads(msg.data)["i"]))

    async def main() -> None:
        nc = await nats.connect(url)
        workers = await _two_workers(nc, stream, handler)
        waits: list[asyncio.Future] = []
        try:
            old_marks = await _publish(nc, stream, range(ROUNDS))  # 4 partitions: 0..3
            assert set(old_marks) == {0, 1, 2, 3}

            async def old_applied() -> bool:
                return (await read_lag(nc, stream, GROUP)).drained

            await _until(old_applied, "the old layout applied")
            run = await asyncio.to_thread(_repartition_cli, url, stream, "subjects-switched")
            assert run.returncode == -signal.SIGKILL, (run.returncode, run.stderr)
            s = await describe(nc, stream)
            assert s.pending_switch is not None and s.current_partitions == 3

            # every old record applied, none published on the new layout yet: still not
            # drained, the switch point is pending (the closed layout's records may not all
            # be stored, and the group cannot move on)
            lag = await read_lag(nc, stream, GROUP)
            assert (lag.epoch, lag.stream_epoch, lag.total_lag) == (0, 1, 0)
            assert not lag.drained
            code, status = await asyncio.to_thread(_status_json, url, stream)
            assert code == 0 and status["drained"] is False
            # said once, by the group, not only by its members (prefixed with their ids)
            said = [p for p in status["problems"] if command in p]
            assert said and not said[0].startswith(("w1:", "w2:")), status["problems"]
            assert not [p for p in status["problems"] if p.startswith(("w1:", "w2:"))]
            listed = await summarize_group(nc, GroupRef(stream, GROUP))  # group list
            assert not listed.drained and [p for p in listed.problems if command in p]
            # info reports it too, to a script as well (exit 0: a report, like status)
            code, info = await asyncio.to_thread(_cli_json, url, "info", "--stream", stream)
            assert code == 0 and [p for p in info["problems"] if command in p], info
            # the poke-mode sensor by the stream's last sequences now (the new layout's: 0)
            assert not await asyncio.to_thread(_poke, stream, None)

            # a wait by default marks ends once the repartition stayed unfinished for the
            # no-members bound, naming the command (not at its 20 s timeout)
            with pytest.raises(RepartitionUnfinishedError) as unfinished:
                await wait_drained(nc, stream, GROUP, timeout=20, no_members_timeout=3)
            assert command in str(unfinished.value)

            new_marks = await _publish(nc, stream, range(ROUNDS, 2 * ROUNDS))  # 3 partitions
            assert set(new_marks) == {0, 1, 2}
            # exact: nothing of the old layout left, every new-layout record (none applied)
            lag = await read_lag(nc, stream, GROUP)
            new = ROUNDS * KEYS
            assert (lag.epoch, lag.later, lag.total_lag, lag.drained) == (0, new, new, False)

            # the old layout's marks (partition 3 is none of the new layout's) wait, and at
            # the deadline say why
            with pytest.raises(DrainTimeoutError) as timed_out:
                await wait_drained(
                    nc, stream, GROUP, marks=old_marks, timeout=6, no_members_timeout=None
                )
            assert command in str(timed_out.value)

            for marks in (old_marks, new_marks):
                waits.append(
                    asyncio.ensure_future(
                        wait_drained(
                            nc, stream, GROUP, marks=marks, timeout=120, no_members_timeout=None
                        )
                    )
                )
            await asyncio.sleep(3.0)
            assert not any(w.done() for w in waits), [w for w in waits if w.done()]
            assert len(set(applied)) == ROUNDS * KEYS  # nothing of the new layout yet

            rerun = await asyncio.to_thread(_repartition_cli, url, stream, None)
            assert rerun.returncode == 0, rerun.stderr
            assert json.loads(rerun.stdout)["action"] == "completed"
            for progress in await asyncio.gather(*waits):
                assert progress.done
            assert len(set(applied)) == 2 * ROUNDS * KEYS  # when the waits returned
            lag = await read_lag(nc, stream, GROUP)
            assert (lag.epoch, lag.total_lag, lag.drained) == (1, 0, True)
            code, status = await asyncio.to_thread(_status_json, url, stream)
            assert code == 0 and status["drained"] is True

            async def no_problem() -> bool:  # a member's report goes with its next heartbeat
                _, status = await asyncio.to_thread(_status_json, url, stream)
                return not [p for p in status["problems"] if command in p]

            await _until(no_problem, "no pending switch point reported", timeout=30)
            assert await asyncio.to_thread(_poke, stream, old_marks)
            assert await asyncio.to_thread(_poke, stream, None)
        finally:
            for f in waits:
                f.cancel()
            for w in workers:
                await w.stop()
            await nc.close()

    asyncio.run(main())


def test_a_wait_begun_on_a_pending_switch_waits_for_the_layout_a_later_repartition_closed(
    shared_nats_server, unique_name
):
    """A wait that began while a switch point was pending, and saw it recorded by a re-run
    that also repartitioned again (epoch 1 closed too, the stream at epoch 2), waits until
    the group has applied epoch 1's records. It used to compare the marks with the newest
    switch point, which left none of them, and return once the group had reached epoch 1:
    "drained" with every epoch-1 record still unapplied (found by the cluster explorer,
    seed 23)."""
    url, stream = shared_nats_server.url, unique_name
    gate = asyncio.Event()  # holds every record of the second round (epoch 1's)
    applied: list[tuple[str, int]] = []
    when_returned: list[int] = []

    async def handler(msg) -> None:
        i = json.loads(msg.data)["i"]
        if i >= ROUNDS:
            await gate.wait()
        applied.append((msg.key, i))

    async def main() -> None:
        nc = await nats.connect(url)
        workers = await _two_workers(nc, stream, handler)
        wait: asyncio.Future | None = None
        try:
            await _publish(nc, stream, range(ROUNDS))

            async def old_applied() -> bool:
                return (await read_lag(nc, stream, GROUP)).drained

            await _until(old_applied, "the first layout applied")
            run = await asyncio.to_thread(_repartition_cli, url, stream, "subjects-switched")
            assert run.returncode == -signal.SIGKILL, (run.returncode, run.stderr)
            await _publish(nc, stream, range(ROUNDS, 2 * ROUNDS))  # epoch 1: 3 partitions

            wait = asyncio.ensure_future(
                wait_drained(nc, stream, GROUP, timeout=120, no_members_timeout=None)
            )
            wait.add_done_callback(lambda _: when_returned.append(len(set(applied))))
            rerun = await asyncio.to_thread(_repartition_cli, url, stream, None, 2)
            assert rerun.returncode == 0, rerun.stderr
            s = await describe(nc, stream)
            assert (s.current_epoch, s.pending_switch) == (2, None)

            async def on_epoch_1() -> bool:  # epoch 0 finished: the group moved on
                return (await read_lag(nc, stream, GROUP)).epoch == 1

            await _until(on_epoch_1, "the group on epoch 1")
            # the wait has seen the switch recorded (it looks every CHECK_EVERY seconds)
            await asyncio.sleep(2 * CHECK_EVERY + 1.0)
            assert not wait.done(), (wait.result(), len(set(applied)))
            assert len(set(applied)) == ROUNDS * KEYS

            gate.set()
            progress = await wait
            assert progress.done
            assert when_returned == [2 * ROUNDS * KEYS]  # every record applied when it did
            lag = await read_lag(nc, stream, GROUP)
            assert (lag.epoch, lag.total_lag, lag.drained) == (2, 0, True)
        finally:
            gate.set()
            if wait is not None:
                wait.cancel()
            for w in workers:
                await w.stop()
            await nc.close()

    asyncio.run(main())


def test_a_group_is_not_drained_while_a_layout_it_has_not_passed_is_pending():
    caught_up = (PartitionLag(0, 10, 10, 10, 0),)
    on_old = {"epoch": 0, "stream_epoch": 1, "stats_epoch": 0}
    assert GroupLag("S", "g", caught_up, **on_old).drained  # switch recorded, nothing new
    assert not GroupLag("S", "g", caught_up, **on_old, pending_switch=0).drained
    # an earlier version let the group past an entry it recorded as 0 (an empty layout),
    # which now reads as pending: the group's own layout is not in doubt
    passed = {"epoch": 1, "stream_epoch": 1, "stats_epoch": 1, "pending_switch": 0}
    assert GroupLag("S", "g", caught_up, **passed).drained
    # a wait is not done while the switch point is pending, even with no mark to compare
    assert DrainProgress({}, {}, 0.0).done
    assert not DrainProgress({}, {}, 0.0, pending_switch=0).done
