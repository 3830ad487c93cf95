"""Drained means drained: a run's high-water marks cover every partition the run stored,
whatever attempt stored it (an attempt SIGKILLed mid-publish, then retried), and they only
ever go up across attempts (real nats-server, a real killed process)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import nats
from locations import TESTS

from airflow_nats_ordered.core.publish.runs import RunLedger, publish_run
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.inputs.files import records_from_rows

P0, P1 = 500, 3000  # records of partition 0, then of partition 1 (the figures)


def keys_of(partition: int, n: int, partitions: int = 2) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        k = f"key{i}"
        if partition_for(k, partitions) == partition:
            out.append(k)
        i += 1
    return out


def rows() -> list[dict]:
    """Partition 0's records first, then partition 1's: an attempt killed in the middle has
    stored all of partition 0 and part of partition 1."""
    k0, k1 = keys_of(0, 7), keys_of(1, 11)
    first = [{"k": k0[i % 7], "p": 0, "i": i} for i in range(P0)]
    return first + [{"k": k1[i % 11], "p": 1, "i": P0 + i} for i in range(P1)]


#: attempt 1, run in its own process: publishes partition 0 and the first 1000 records of
#: partition 1 as the run, then hangs (reading more input) until it is SIGKILLed
ATTEMPT = """
import asyncio, sys, json
import nats
sys.path.insert(0, {tests!r})
sys.path.insert(0, {tests!r} + "/core/publish")
from test_run_marks import rows
from airflow_nats_ordered.core.publish.runs import publish_run
from airflow_nats_ordered.inputs.files import records_from_rows

async def records():
    for i, rec in enumerate(records_from_rows(rows(), key_field="k")):
        if i == {stop}:
            print("hanging", flush=True)
            await asyncio.sleep(3600)
        yield rec

async def main():
    nc = await nats.connect({url!r})
    await publish_run(nc, {stream!r}, records(), producer_id={pid!r})

asyncio.run(main())
"""


async def subject_counts(nc, stream: str) -> dict[str, int]:
    info = await nc.jetstream().stream_info(stream, subjects_filter=">")
    return dict(info.state.subjects or {})


def kill_after_partition_0(url: str, stream: str, pid: str, stop: int = P0 + 1000) -> None:
    """Run attempt 1 in a subprocess and SIGKILL it once partition 0 is fully stored and
    partition 1 partly (polled on the stream, 60 s bound)."""
    script = ATTEMPT.format(tests=str(TESTS), url=url, stream=stream, pid=pid, stop=stop)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)])

    async def wait_stored() -> dict[str, int]:
        nc = await nats.connect(url)
        ps = await describe(nc, stream)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                counts = await subject_counts(nc, stream)
                if counts.get(ps.subject(0), 0) >= P0 and counts.get(ps.subject(1), 0) >= stop - P0:
                    return counts
                assert proc.poll() is None, f"attempt 1 exited early ({proc.returncode})"
                await asyncio.sleep(0.05)
            raise AssertionError(f"attempt 1 did not store its records in 60 s: {counts}")
        finally:
            await nc.close()

    try:
        asyncio.run(wait_stored())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def test_a_retry_after_a_killed_attempt_returns_marks_for_every_partition_it_stored(
    nats_url, unique_name
):
    pid = f"{unique_name}.publish.attempts"

    async def setup():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await nc.close()

    asyncio.run(setup())
    kill_after_partition_0(nats_url, unique_name, pid)

    async def retry():
        nc = await nats.connect(nats_url)
        ps = await describe(nc, unique_name)
        js = nc.jetstream()
        last0 = (await js.get_last_msg(unique_name, ps.subject(0))).seq
        result = await publish_run(
            nc, unique_name, records_from_rows(rows(), key_field="k"), producer_id=pid
        )
        last1 = (await js.get_last_msg(unique_name, ps.subject(1))).seq
        stored = await subject_counts(nc, unique_name)
        stored = {p: stored.get(ps.subject(p), 0) for p in range(2)}
        ledger = await (await RunLedger.open(nc, unique_name)).get(pid)
        await nc.close()
        return result, last0, last1, stored, ledger

    result, last0, last1, stored, ledger = asyncio.run(retry())
    rec = result.record
    assert stored == {0: P0, 1: P1}, stored
    assert rec.status == "complete" and rec.attempts == 2
    assert rec.acked_per_partition == {0: P0, 1: P1}
    assert rec.high_water_marks == {0: last0, 1: last1}, (
        "the retry's marks must cover partition 0, which only the killed attempt stored"
    )
    assert ledger is not None and ledger.high_water_marks == rec.high_water_marks
    # what the operator pushes as XCom, and what the drain sensor reads from it
    assert result.to_dict()["high_water_marks"] == {"0": last0, "1": last1}


def wait_ledger(url: str, stream: str, pid: str, done) -> None:
    """Poll the run's ledger record until ``done(record)`` (60 s bound)."""

    async def go() -> None:
        nc = await nats.connect(url)
        try:
            ledger = await RunLedger.open(nc, stream)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rec = await ledger.get(pid)
                if rec is not None and done(rec):
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"the ledger never showed the expected progress: {rec}")
        finally:
            await nc.close()

    asyncio.run(go())


def test_a_killed_attempts_progress_records_carry_its_marks_and_a_drain_by_run_waits_for_them(
    nats_url, unique_name, monkeypatch
):
    """What a drain reads by run name while an attempt is dead: the marks of what it
    stored. A sensor on that run must not succeed while the group has committed nothing."""
    from airflow_dags import nats_connection

    from airflow_nats_ordered.core.group.store import GroupStore
    from airflow_nats_ordered.core.worker.config import WorkerConfig
    from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    pid = f"{unique_name}.publish.progress"

    async def setup():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await GroupStore.open(nc, WorkerConfig(unique_name, "g").group_config)
        await nc.close()

    asyncio.run(setup())
    # attempt 1: killed after a progress record counted partition 0 whole
    script = ATTEMPT.format(
        tests=str(TESTS), url=nats_url, stream=unique_name, pid=pid, stop=P0 + 200
    )
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)])
    try:
        # (today's code never records marks before the end: this wait then times out)
        wait_ledger(
            nats_url,
            unique_name,
            pid,
            lambda r: r.acked_per_partition == {0: P0, 1: 200} and r.high_water_marks.get(0),
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

    async def read():
        nc = await nats.connect(nats_url)
        ps = await describe(nc, unique_name)
        last0 = (await nc.jetstream().get_last_msg(unique_name, ps.subject(0))).seq
        rec = await (await RunLedger.open(nc, unique_name)).get(pid)
        await nc.close()
        return last0, rec

    last0, rec = asyncio.run(read())
    assert rec is not None and rec.status == "running"
    assert rec.high_water_marks.get(0) == last0, (
        f"the progress record of the killed attempt has marks {rec.high_water_marks}, "
        f"not partition 0's last record {last0}"
    )
    sensor = NatsGroupDrainSensor(
        task_id="drained", stream=unique_name, group="g", run=pid, deferrable=False
    )
    assert sensor.poke({}) is False, "drained by run name while nothing was committed"


RETRIED = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

def keys_of(partition, n):
    out, i = [], 0
    while len(out) < n:
        if partition_for(f"key{{i}}", 2) == partition:
            out.append(f"key{{i}}")
        i += 1
    return out

def rows():
    k0, k1 = keys_of(0, 7), keys_of(1, 11)
    first = [{{"k": k0[i % 7], "p": 0, "i": i}} for i in range({p0})]
    return first + [{{"k": k1[i % 11], "p": 1, "i": {p0} + i}} for i in range({p1})]

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    publish = NatsPublishOperator(
        task_id="publish", stream="{stream}", key_field="k", records_callable=rows,
        producer_id="{pid}",
    )
    drained = NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", high_water_marks=publish.output,
        no_members_timeout=30, timeout=120, deferrable=True,
    )
    publish >> drained
"""


def test_a_drain_on_a_retried_publish_waits_for_what_the_killed_try_stored(
    nats_url, unique_name, monkeypatch
):
    """The issue's case end to end: try 1 of the publish task is SIGKILLed after partition
    0 is stored; the retry (NatsPublishOperator in a DAG run) resumes; the drain sensor on
    its XCom must wait until the workers committed partition 0 too."""
    import threading

    from airflow_dags import BackgroundPool, dag_file, nats_connection, task_states

    from airflow_nats_ordered.core.group.store import GroupStore
    from airflow_nats_ordered.core.worker.config import WorkerConfig

    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    pid = f"{unique_name}.publish.dag"
    config = WorkerConfig(unique_name, "g", member_id="af", lease_ttl=2.0, commit_interval=0.2)

    async def setup():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await GroupStore.open(nc, config.group_config)
        await nc.close()

    asyncio.run(setup())
    kill_after_partition_0(nats_url, unique_name, pid)

    gate = threading.Event()
    released: list[float] = []
    handled = {0: 0, 1: 0}

    async def handler(msg):
        if msg.partition == 0:
            while not gate.is_set():  # partition 0's worker is alive but has not caught up
                await asyncio.sleep(0.05)
        handled[msg.partition] += 1

    def release_later() -> None:
        time.sleep(10)
        released.append(time.monotonic())
        gate.set()

    source = RETRIED.replace("{p0}", str(P0)).replace("{p1}", str(P1))
    with (
        dag_file(source, stream=unique_name, pid=pid) as dag,
        BackgroundPool(nats_url, config, handler, size=1),
    ):
        threading.Thread(target=release_later, daemon=True).start()
        run = dag.test()
        finished = time.monotonic()
        handled_at_end = dict(handled)
        marks = run.get_task_instance("publish").xcom_pull(task_ids="publish")
    assert task_states(run) == {"publish": "success", "drained": "success"}, task_states(run)
    assert released and finished > released[0], "the sensor succeeded before partition 0 ran"
    assert handled_at_end[0] == P0, "the sensor succeeded before partition 0 was committed"
    assert set(marks["high_water_marks"]) == {"0", "1"}, marks["high_water_marks"]


def test_a_spark_run_records_a_mark_for_every_partition_its_tasks_stored(nats_url, unique_name):
    """The Spark driver's record of a run: a task report whose publisher could not read a
    partition's last sequence (0: the server did not answer in time) still yields that
    partition's mark, and a partition only an earlier attempt stored keeps its mark."""
    from airflow_nats_ordered.core.publish.config import PublisherConfig
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
    from airflow_nats_ordered.spark.options import SinkOptions
    from airflow_nats_ordered.spark.runs import record_run
    from airflow_nats_ordered.spark.task import TaskReport

    pid = f"{unique_name}.spark"
    options = SinkOptions(stream=unique_name, key_column="k", producer_id=pid)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        ps = await describe(nc, unique_name)
        async with OrderedPublisher(nc, unique_name, PublisherConfig(producer_id=pid)) as pub:
            for rec in records_from_rows(rows()[: P0 + 100], key_field="k"):
                await pub.publish(rec.key, rec.payload)
        js = nc.jetstream()
        last = {p: (await js.get_last_msg(unique_name, ps.subject(p))).seq for p in (0, 1)}
        report = TaskReport(
            task=0,
            attempt=0,
            producer_id=pid,
            routed=True,
            rows=P0 + 100,
            partitions={
                0: {
                    "offset": 0,
                    "accepted": P0,
                    "acked": P0,
                    "failed": 0,
                    "duplicates": 0,
                    "last_seq": 0,
                },
                1: {
                    "offset": 0,
                    "accepted": 100,
                    "acked": 100,
                    "failed": 0,
                    "duplicates": 0,
                    "last_seq": last[1],
                },
            },
        )
        first = await record_run(nc, options, pid, [report])
        # a later attempt whose task only re-ran partition 1 (partition 0 passed over)
        again = TaskReport(
            task=0,
            attempt=1,
            producer_id=pid,
            routed=True,
            rows=100,
            partitions={1: report.partitions[1]},
        )
        second = await record_run(nc, options, pid, [again])
        await nc.close()
        return last, first, second

    last, first, second = asyncio.run(go())
    assert first.status == "complete" and first.high_water_marks == last, first
    assert second.high_water_marks == last, "a later attempt lost partition 0's mark"


def test_a_cli_publish_rerun_after_a_kill_reports_marks_for_every_partition(
    nats_url, unique_name, tmp_path
):
    """`nats-ordered publish` SIGKILLed after partition 0 is stored, then run again on the
    same input with the same --producer-id (inside the duplicate window): its report's
    marks cover partition 0, which the rerun stored nothing new on."""
    pid = f"{unique_name}.cli"
    lines = [json.dumps(r) + "\n" for r in rows()]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(lines))

    async def setup():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await nc.close()

    asyncio.run(setup())
    cli = [
        sys.executable,
        "-m",
        "airflow_nats_ordered.cli",
        "publish",
        "--stream",
        unique_name,
        "--key-field",
        "k",
        "--producer-id",
        pid,
        "--server",
        nats_url,
        "--json",
    ]
    # attempt 1 reads stdin: partition 0 and part of partition 1, then the pipe stays open
    proc = subprocess.Popen([*cli, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    proc.stdin.write("".join(lines[: P0 + 1000]).encode())
    proc.stdin.flush()

    async def wait_stored() -> None:
        nc = await nats.connect(nats_url)
        ps = await describe(nc, unique_name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = await subject_counts(nc, unique_name)
            if counts.get(ps.subject(0), 0) >= P0 and counts.get(ps.subject(1), 0) >= 1000:
                break
            await asyncio.sleep(0.05)
        await nc.close()

    try:
        asyncio.run(wait_stored())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    done = subprocess.run([*cli, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)

    async def lasts():
        nc = await nats.connect(nats_url)
        ps = await describe(nc, unique_name)
        js = nc.jetstream()
        out = {str(p): (await js.get_last_msg(unique_name, ps.subject(p))).seq for p in (0, 1)}
        counts = await subject_counts(nc, unique_name)
        await nc.close()
        return out, [counts.get(ps.subject(p), 0) for p in (0, 1)]

    last, counts = asyncio.run(lasts())
    assert counts == [P0, P1], counts
    assert report["high_water_marks"] == last, report["high_water_marks"]
