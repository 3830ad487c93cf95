"""Example DAG: rewind a group to the start of its stream with NatsResetGroupOperator, so
its workers process everything again (after fixing a handler's bug, say).

Needs a NATS server with JetStream (connection ``nats_default``) and workers of group
``GROUP`` running beside Airflow (``nats-ordered pool``; the system tests start two, see
tests/system/conftest.py). docs/howto/reset-group.md quotes the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_nats_ordered.operators.group import NatsResetGroupOperator
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_reset_group"
STREAM = f"EXAMPLE_RESET_{ENV_ID}"
PARTITIONS = 4
GROUP = "billing"

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:
    publish = NatsPublishOperator(
        task_id="publish",
        stream=STREAM,
        records=[{"customer": f"c{i % 5}", "order": i} for i in range(20)],
        key_field="customer",
    )
    drained = NatsGroupDrainSensor(
        task_id="drained",
        stream=STREAM,
        group=GROUP,
        high_water_marks=publish.output,
        deferrable=True,
    )

    # [START howto_operator_nats_reset_group]
    rewind = NatsResetGroupOperator(
        task_id="rewind",
        stream=STREAM,
        group=GROUP,
        to="earliest",  # or "latest", or {partition: sequence}
        confirm=True,  # required: the group re-processes (or skips) messages
    )
    # [END howto_operator_nats_reset_group]

    @task
    def check(reset: dict) -> None:
        # each partition's position is now before its first message still in the stream
        moved = [p for p in reset["positions"].values() if p["to"] < p["from"]]
        assert moved and all(p["to"] <= p["from"] for p in reset["positions"].values()), reset

    publish >> drained >> rewind
    check(rewind.output)


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
