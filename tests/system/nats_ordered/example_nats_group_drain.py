"""Example DAG: wait with the deferrable NatsGroupDrainSensor until a group of workers has
processed what the publish task stored (the sensor defers to NatsGroupDrainTrigger).

Needs a NATS server with JetStream (connection ``nats_default``) and workers of group
``GROUP`` running beside Airflow, as ``nats-ordered pool --stream STREAM --group GROUP
--handler ...`` runs them; the system tests start such a pool (tests/system/conftest.py).
docs/howto/group-drain-sensor.md and docs/howto/group-drain-trigger.md quote the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG

from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_group_drain"
STREAM = f"EXAMPLE_DRAIN_{ENV_ID}"
PARTITIONS = 4
GROUP = "billing"

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:
    provision = NatsProvisionStreamOperator(
        task_id="provision", stream=STREAM, partitions=PARTITIONS
    )
    publish = NatsPublishOperator(
        task_id="publish",
        stream=STREAM,
        records=[{"customer": f"c{i % 5}", "order": i} for i in range(20)],
        key_field="customer",
    )

    # [START howto_sensor_nats_group_drain]
    drained = NatsGroupDrainSensor(
        task_id="drained",
        stream=STREAM,
        group=GROUP,
        high_water_marks=publish.output,  # the marks of what this run published
        deferrable=True,  # wait in the triggerer, holding no worker slot
        no_members_timeout=60,  # fail when no worker of the group is alive this long
        timeout=600,
    )
    # [END howto_sensor_nats_group_drain]

    provision >> publish >> drained


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
