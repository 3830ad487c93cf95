"""The provider's operators and the deferrable drain sensor in real DAG runs (``dag.test()``,
a real metadata DB, a real nats-server, a real worker pool)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time

from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig

PIPELINE = """
import datetime as dt
from airflow.sdk import DAG, task
from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

def records(n, keys):
    return [{{"k": f"key{{i % keys}}", "i": i}} for i in range(n)]

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    provision = NatsProvisionStreamOperator(task_id="provision", stream="{stream}", partitions=4)
    publish = NatsPublishOperator(
        task_id="publish", stream="{stream}", key_field="k",
        records_callable=records, op_kwargs={{"n": {n}, "keys": 40}},
    )
    drained = NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", high_water_marks=publish.output,
        no_members_timeout={no_members_timeout}, timeout={timeout}, deferrable=True,
    )
    provision >> publish >> drained
"""


def _config(stream: str, **kw) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="af", lease_ttl=2.0, commit_interval=0.2, **kw)


def _count(url: str, stream: str) -> int:
    async def count(nc) -> int:
        return (await nc.jetstream().stream_info(stream)).state.messages

    return on_server(url, count)


def _stream_and_group(url: str, stream: str) -> None:
    """What a deployment has before the DAG runs: the stream and a group that has existed."""

    async def make(nc) -> None:
        await provision(nc, StreamSpec(stream, partitions=4))
        await GroupStore.open(nc, _config(stream).group_config)

    on_server(url, make)


def test_drain_sensor_waits_for_paused_workers_and_succeeds_after_they_commit(
    nats_url, unique_name, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    n = 400
    seen: list[int] = []
    gate = threading.Event()
    released_at: list[float] = []

    async def handler(msg):
        while not gate.is_set():  # paused workers: alive, owning partitions, not processing
            await asyncio.sleep(0.05)
        seen.append(json.loads(msg.data)["i"])

    def release_later() -> None:
        time.sleep(8)
        released_at.append(time.monotonic())
        gate.set()

    _stream_and_group(nats_url, unique_name)
    with (
        dag_file(PIPELINE, stream=unique_name, n=n, no_members_timeout=30, timeout=120) as dag,
        BackgroundPool(nats_url, _config(unique_name), handler),
    ):
        threading.Thread(target=release_later, daemon=True).start()
        run = dag.test()
        finished = time.monotonic()
    assert task_states(run) == {
        "provision": "success",
        "publish": "success",
        "drained": "success",
    }, task_states(run)
    assert released_at and finished > released_at[0], "the sensor succeeded before any work"
    assert sorted(set(seen)) == list(range(n)), "the sensor succeeded before everything ran"


def test_rerunning_a_complete_publish_stores_nothing_and_the_ledger_says_why(
    nats_url, unique_name, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    async def handler(msg):
        pass

    when = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)
    _stream_and_group(nats_url, unique_name)
    with (
        dag_file(PIPELINE, stream=unique_name, n=100, no_members_timeout=30, timeout=60) as dag,
        BackgroundPool(nats_url, _config(unique_name), handler),
    ):
        first = task_states(dag.test(logical_date=when))
        stored = _count(nats_url, unique_name)
        # dag.test() of the same logical date replaces the run: a clear-and-rerun
        again = task_states(dag.test(logical_date=when))

    async def ledger(nc):
        runs = await RunLedger.open(nc, unique_name)
        return await runs.get(f"{dag.dag_id}.publish.{when.isoformat()}")

    rec = on_server(nats_url, ledger)
    assert first["drained"] == "success" and again["drained"] == "success", (first, again)
    assert stored == 100 and _count(nats_url, unique_name) == 100
    assert rec is not None and rec.status == "complete" and rec.acked == 100
    assert rec.attempts == 1, "the complete run was published again"


def test_drain_sensor_fails_fast_when_no_worker_consumes_the_group(
    nats_url, unique_name, monkeypatch, capfd
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    _stream_and_group(nats_url, unique_name)
    # the sensor's timeout (600 s) is far beyond the no-members bound (2 s): failing for the
    # reason below, not for the timeout, is what "fails fast" means (no wall-clock budget)
    with dag_file(PIPELINE, stream=unique_name, n=50, no_members_timeout=2, timeout=600) as dag:
        run = dag.test()
    out = capfd.readouterr()
    assert task_states(run)["drained"] == "failed", task_states(run)
    assert "no worker pool is consuming group" in out.out + out.err


OPERATE = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.operators.group import NatsRebalanceOperator, NatsResetGroupOperator

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    cordon = NatsRebalanceOperator(
        task_id="cordon", stream="{stream}", group="g", cordon=["af-2"]
    )
    by_load = NatsRebalanceOperator(
        task_id="by_load", stream="{stream}", group="g", weights="rates", rate_window=600
    )
    rewind = NatsResetGroupOperator(
        task_id="rewind", stream="{stream}", group="g", to="earliest", confirm=True
    )
    cordon >> by_load >> rewind
"""


def test_rebalance_and_reset_operators_in_a_dag(nats_url, unique_name, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    seen: list[int] = []

    async def handler(msg):
        seen.append(json.loads(msg.data)["i"])

    async def publish(nc):
        from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(200):
                await pub.publish("hot" if i % 4 else f"k{i}", json.dumps({"i": i}).encode())

    _stream_and_group(nats_url, unique_name)
    on_server(nats_url, publish)
    with (
        dag_file(OPERATE, stream=unique_name) as dag,
        BackgroundPool(nats_url, _config(unique_name), handler, size=2),
    ):
        run = dag.test()
        xcom = {ti.task_id: ti.xcom_pull(task_ids=ti.task_id) for ti in run.get_task_instances()}
        deadline = time.monotonic() + 30
        while len(seen) < 400 and time.monotonic() < deadline:  # the rewind replays all 200
            time.sleep(0.2)
    assert task_states(run) == {"cordon": "success", "by_load": "success", "rewind": "success"}
    assert "af-2" not in xcom["cordon"]["owners"].values()
    assert xcom["by_load"]["imbalance_after"] <= xcom["by_load"]["imbalance_before"]
    assert sorted(seen) == sorted(list(range(200)) * 2), "the rewind did not replay once"


POISONED = PIPELINE.replace("records_callable=records", "records_callable=records_with_poison")
POISONED = POISONED.replace(
    "def records(n, keys):",
    'def records_with_poison(n, keys):\n    return [*records(n, keys), {{"k": "key1", "i": -1}}]'
    "\n\ndef records(n, keys):",
)


def test_drain_sensor_fails_with_the_reason_when_a_partition_is_blocked(
    nats_url, unique_name, monkeypatch, capfd
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    def handler(msg):
        if json.loads(msg.data)["i"] < 0:
            raise RuntimeError("ledger rejected record -1")

    _stream_and_group(nats_url, unique_name)
    with (
        dag_file(POISONED, stream=unique_name, n=50, no_members_timeout=30, timeout=600) as dag,
        BackgroundPool(
            nats_url, _config(unique_name, poison="block", max_retries=0), handler, size=1
        ),
    ):
        run = dag.test()
    out = capfd.readouterr()
    # failed for the block (its reason), long before the sensor's 600 s timeout
    assert task_states(run)["drained"] == "failed", task_states(run)
    assert "ledger rejected record -1" in out.out + out.err
    assert "Fix the handler" in out.out + out.err
