"""Example DAG: change a stream's partition count with NatsRepartitionStreamOperator,
keeping every key's order.

Needs only a NATS server with JetStream, reached through the Airflow connection
``nats_default``. docs/howto/repartition-stream.md quotes the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_nats_ordered.operators.streams import (
    NatsProvisionStreamOperator,
    NatsRepartitionStreamOperator,
)

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_repartition_stream"
STREAM = f"EXAMPLE_REPARTITION_{ENV_ID}"

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:
    provision = NatsProvisionStreamOperator(task_id="provision", stream=STREAM, partitions=4)

    # [START howto_operator_nats_repartition_stream]
    repartition = NatsRepartitionStreamOperator(
        task_id="repartition",
        stream=STREAM,
        partitions=8,  # the new count; a stream that has it already is left as it is
    )
    # [END howto_operator_nats_repartition_stream]

    # the same count again changes nothing: a retry of the task succeeds
    again = NatsRepartitionStreamOperator(task_id="again", stream=STREAM, partitions=8)

    @task
    def check(first: dict, second: dict) -> None:
        assert first["action"] == "repartitioned" and first["epoch"] == 1, first
        assert (first["previous_partitions"], first["partitions"]) == (4, 8), first
        assert second["action"] == "unchanged" and second["epoch"] == 1, second

    provision >> repartition >> again
    check(repartition.output, again.output)


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
