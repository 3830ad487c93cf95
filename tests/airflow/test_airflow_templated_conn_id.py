"""``nats_conn_id`` is a template field of every operator and sensor (issue 30 defect 5), as
``conn_id`` is in Airflow's own providers: one DAG file serves several deployments
(``nats_{{ params.env }}``, ``{{ var.value.nats_conn }}``). Before, the template reached
the hook as written and every task failed "The conn_id `nats_{{ params.env }}` isn't
defined". Checked by a real DAG run (``dag.test()``, the session's metadata DB, a real
nats-server, a real worker pool for the group the sensor waits on)."""

from __future__ import annotations

import inspect
import json

import pytest
from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states
from airflow_processes import metadata_db, query

from airflow_nats_ordered import get_provider_info
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig

DAG_SOURCE = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.operators.group import NatsRebalanceOperator, NatsResetGroupOperator
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.operators.streams import (
    NatsProvisionStreamOperator, NatsRepartitionStreamOperator,
)
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

BY_PARAM = "nats_{{{{ params.env }}}}"
BY_VARIABLE = "{{{{ var.value.{variable} }}}}"

with DAG(
    dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1),
    params={{"env": "{env}"}},
) as dag:
    provision = NatsProvisionStreamOperator(
        task_id="provision", stream="{stream}", partitions=2, nats_conn_id=BY_PARAM,
    )
    publish = NatsPublishOperator(
        task_id="publish", stream="{stream}", key_field="k",
        records=[{{"k": "a"}}, {{"k": "b"}}, {{"k": "c"}}], nats_conn_id=BY_VARIABLE,
    )
    drained = NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", high_water_marks=publish.output,
        deferrable={deferrable}, poke_interval=0.5, timeout=90, nats_conn_id=BY_PARAM,
    )
    rebalance = NatsRebalanceOperator(
        task_id="rebalance", stream="{stream}", group="g", nats_conn_id=BY_VARIABLE,
    )
    reset = NatsResetGroupOperator(
        task_id="reset", stream="{stream}", group="g", to="latest", confirm=True,
        nats_conn_id=BY_PARAM,
    )
    repartition = NatsRepartitionStreamOperator(
        task_id="repartition", stream="{stream}", partitions=2, nats_conn_id=BY_VARIABLE,
    )
    provision >> publish >> drained >> rebalance >> reset >> repartition
"""


def _operator_classes() -> list[type]:
    """Every operator and sensor class of the provider that takes a ``nats_conn_id``."""
    import importlib

    info = get_provider_info()
    modules = [
        m for kind in ("operators", "sensors") for e in info[kind] for m in e["python-modules"]
    ]
    found = []
    for name in modules:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and "nats_conn_id" in inspect.signature(cls).parameters:
                found.append(cls)
    return found


def test_every_operator_and_sensor_templates_nats_conn_id() -> None:
    classes = _operator_classes()
    assert len(classes) == 7, [c.__name__ for c in classes]  # 5 operators, spark, the sensor
    untemplated = [c.__name__ for c in classes if "nats_conn_id" not in c.template_fields]  # type: ignore[attr-defined]
    assert untemplated == []


@pytest.mark.parametrize("deferrable", [False, True], ids=["poke", "deferred"])
def test_a_templated_conn_id_is_rendered_in_a_real_dag_run(
    nats_url, unique_name, monkeypatch, deferrable
):
    env = unique_name.lower()
    variable = f"nats_conn_{env}"
    # the connection exists only under the rendered id; nats_default points nowhere
    monkeypatch.setenv(f"AIRFLOW_CONN_NATS_{env.upper()}", nats_connection(nats_url))
    monkeypatch.setenv(f"AIRFLOW_VAR_{variable.upper()}", f"nats_{env}")
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection("nats://127.0.0.1:1"))
    config = WorkerConfig(
        unique_name, "g", member_id="m1", lease_ttl=2.0, commit_interval=0.2, commit_every=1
    )

    async def make(nc) -> None:
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await GroupStore.open(nc, config.group_config)

    async def handle(msg) -> None:
        return None

    on_server(nats_url, make)
    with (
        dag_file(
            DAG_SOURCE, stream=unique_name, env=env, variable=variable, deferrable=deferrable
        ) as dag,
        BackgroundPool(nats_url, config, handle, size=1),
    ):
        run = dag.test()
    states = task_states(run)
    assert set(states.values()) == {"success"}, states
    # and Airflow shows the rendered id (Rendered Template), as for any template field
    rows = query(
        metadata_db(),
        "SELECT task_id, rendered_fields FROM rendered_task_instance_fields WHERE dag_id = ?",
        dag.dag_id,
    )
    shown = {task_id: json.loads(fields)["nats_conn_id"] for task_id, fields in rows}
    assert shown == dict.fromkeys(states, f"nats_{env}"), shown
