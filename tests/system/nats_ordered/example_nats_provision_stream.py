"""Example DAG: create, or verify, a partitioned stream with NatsProvisionStreamOperator.

Needs only a NATS server with JetStream, reached through the Airflow connection
``nats_default``. docs/howto/provision-stream.md quotes the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_provision_stream"
STREAM = f"EXAMPLE_PROVISION_{ENV_ID}"

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:
    # [START howto_operator_nats_provision_stream]
    provision = NatsProvisionStreamOperator(
        task_id="provision",
        stream=STREAM,
        partitions=4,
        duplicate_window=3600,  # seconds; longer than any retry of a publish to the stream
        max_age=7 * 24 * 3600,  # keep messages a week
    )
    # [END howto_operator_nats_provision_stream]

    # the same arguments again change nothing: the stream is verified
    verify = NatsProvisionStreamOperator(
        task_id="verify",
        stream=STREAM,
        partitions=4,
        duplicate_window=3600,
        max_age=7 * 24 * 3600,
    )

    @task
    def check(created: dict, verified: dict) -> None:
        assert created["action"] == "created" and created["partitions"] == 4, created
        assert verified["action"] == "unchanged" and not verified["changes"], verified

    provision >> verify
    check(provision.output, verify.output)


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
