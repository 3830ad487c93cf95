"""A non-deferrable drain sensor fails when no worker consumes the group, as the deferrable
one does (its trigger's no-members rule): with ``deferrable=False`` (the default under
Airflow's ``[operators] default_deferrable``) it used to poke until ``timeout`` while no
member was alive. Real DAG runs (``dag.test()``, reschedule pokes as separate task runs),
a real nats-server, a group that has had workers but has none now."""

from __future__ import annotations

import json

import pytest
from airflow_dags import dag_file, nats_connection, on_server, task_states

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, partition_stats, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig

SENSOR = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", deferrable=False, mode="{mode}",
        poke_interval=1, no_members_timeout=2, timeout={timeout},
    )
"""


@pytest.mark.parametrize("mode", ["poke", "reschedule"])
def test_a_poking_sensor_fails_retryably_when_no_worker_consumes_the_group(
    nats_url, unique_name, monkeypatch, capfd, mode
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    async def make(nc) -> None:
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await GroupStore.open(nc, WorkerConfig(unique_name, "g", member_id="m").group_config)
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(10):
                await pub.publish(f"k{i}", json.dumps({"i": i}).encode())

    on_server(nats_url, make)
    # the sensor's timeout is the test's hang bound: the old sensor poked until it, and
    # failed with AirflowSensorTimeout instead of saying that no worker is consuming
    with dag_file(SENSOR, stream=unique_name, mode=mode, timeout=60) as dag:
        run = dag.test()
    out = capfd.readouterr()
    log = out.out + out.err
    assert task_states(run) == {"drained": "failed"}
    assert "AirflowSensorTimeout" not in log, "the sensor waited for its timeout"
    assert f"no worker pool is consuming group g of stream {unique_name}" in log
    assert "no member has been alive for 2s" in log
    # retryable (workers may come back): an AirflowException, not AirflowFailException
    said = [line for line in log.splitlines() if "no worker pool is consuming" in line]
    assert not any("AirflowFailException" in line for line in said), said


def test_the_no_members_error_counts_only_the_partitions_behind_their_mark(
    nats_url, unique_name, monkeypatch, capfd
):
    """Issue 28 item 7: one of two partitions has committed its last record; the poke logs
    1 partition behind, and the no-members error must say 1 too (it said 2: a caught-up
    partition was counted as having committed nothing)."""
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    async def make(nc) -> int:
        await provision(nc, StreamSpec(unique_name, partitions=2))
        store = await GroupStore.open(
            nc, WorkerConfig(unique_name, "g", member_id="m").group_config
        )
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(20):
                await pub.publish(f"k{i}", json.dumps({"i": i}).encode())
        stats = {s.partition: s.last_seq for s in await partition_stats(nc, unique_name)}
        assert all(stats.values()), stats  # both partitions hold records
        await store.reset(0, stats[0])  # partition 0 is caught up, partition 1 is not
        return stats[1]

    last1 = on_server(nats_url, make)
    with dag_file(SENSOR, stream=unique_name, mode="poke", timeout=60) as dag:
        run = dag.test()
    out = capfd.readouterr()
    log = out.out + out.err
    assert task_states(run) == {"drained": "failed"}
    assert f"group g: 1 partition(s) behind: {{1: (0, {last1})}}" in log
    said = [line for line in log.splitlines() if "no worker pool is consuming" in line]
    assert said and all("while 1 partition(s) are behind their mark" in line for line in said), said
