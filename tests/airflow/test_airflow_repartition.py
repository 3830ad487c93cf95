"""NatsRepartitionStreamOperator in a real DAG run (``dag.test()``, a real metadata DB and
nats-server, a real worker pool): provision 4, publish, repartition to 8, publish again,
the deferrable drain sensor on the second publish's marks, then a poke-mode one on the first
publish's (old-layout) marks (issue 18 part 2)."""

from __future__ import annotations

import json
import threading
from collections import defaultdict

from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig

PIPELINE = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.operators.streams import (
    NatsProvisionStreamOperator, NatsRepartitionStreamOperator,
)
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

def records(first, n, keys):
    return [{{"k": f"key{{i % keys}}", "i": i}} for i in range(first, first + n)]

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    provision = NatsProvisionStreamOperator(task_id="provision", stream="{stream}", partitions=4)
    before = NatsPublishOperator(
        task_id="before", stream="{stream}", key_field="k", msg_id_field="i",
        records_callable=records, op_kwargs={{"first": 0, "n": 60, "keys": 6}},
    )
    repartition = NatsRepartitionStreamOperator(
        task_id="repartition", stream="{stream}", partitions=8
    )
    after = NatsPublishOperator(
        task_id="after", stream="{stream}", key_field="k", msg_id_field="i",
        records_callable=records, op_kwargs={{"first": 60, "n": 60, "keys": 6}},
    )
    drained = NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", high_water_marks=after.output,
        no_members_timeout=60, timeout=120, deferrable=True,
    )
    # poke mode, on the marks of the records published before the switch (old layout)
    drained_before = NatsGroupDrainSensor(
        task_id="drained_before", stream="{stream}", group="g", high_water_marks=before.output,
        no_members_timeout=60, timeout=120, poke_interval=1, deferrable=False,
    )
    provision >> before >> repartition >> after >> drained >> drained_before
"""


def test_repartition_operator_in_a_dag_run_keeps_every_key_in_order(
    nats_url, unique_name, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    seen: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler(msg):
        with lock:
            seen[msg.key].append(json.loads(msg.data)["i"])

    # the deployment's stream exists before its workers start (the DAG's provision verifies it)
    on_server(nats_url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=4)))
    config = WorkerConfig(unique_name, "g", member_id="af", lease_ttl=2.0, commit_interval=0.2)
    with (
        dag_file(PIPELINE, stream=unique_name) as dag,
        BackgroundPool(nats_url, config, handler),
    ):
        run = dag.test()
        applied = {k: list(v) for k, v in seen.items()}
    states = task_states(run)
    assert set(states.values()) == {"success"}, states
    xcom = run.get_task_instance("repartition").xcom_pull(task_ids="repartition")
    assert xcom["action"] == "repartitioned" and xcom["epoch"] == 1
    assert (xcom["previous_partitions"], xcom["partitions"]) == (4, 8)
    # the sensor succeeded only once both layouts were applied: every key, in order
    for k in range(6):
        assert applied[f"key{k}"] == list(range(k, 120, 6)), applied
