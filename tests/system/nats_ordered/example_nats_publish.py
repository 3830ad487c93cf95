"""Example DAG: publish keyed records with NatsPublishOperator, in order per key, as a run.

Needs only a NATS server with JetStream, reached through the Airflow connection
``nats_default``. docs/howto/publish.md quotes the marked parts.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_publish"
STREAM = f"EXAMPLE_PUBLISH_{ENV_ID}"


# [START howto_operator_nats_publish_callable_function]
def daily_orders(customers: int, per_customer: int) -> list[dict]:
    """Any callable returning dicts; the operator calls it with op_kwargs."""
    return [
        {"customer": f"c{c}", "order": n, "amount": 10 * n}
        for n in range(per_customer)
        for c in range(customers)
    ]


# [END howto_operator_nats_publish_callable_function]

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:
    provision = NatsProvisionStreamOperator(task_id="provision", stream=STREAM, partitions=4)

    # [START howto_operator_nats_publish]
    publish = NatsPublishOperator(
        task_id="publish",
        stream=STREAM,
        records=[
            {"customer": "c1", "order": 1, "amount": 30},
            {"customer": "c2", "order": 1, "amount": 12},
            {"customer": "c1", "order": 2, "amount": 5},
        ],
        key_field="customer",  # records of one customer stay in order, on one partition
    )
    # [END howto_operator_nats_publish]

    # [START howto_operator_nats_publish_callable]
    publish_generated = NatsPublishOperator(
        task_id="publish_generated",
        stream=STREAM,
        records_callable=daily_orders,  # or "my_package.orders:daily_orders"
        op_kwargs={"customers": 3, "per_customer": 2},
        key_field="customer",
        order_by="order",  # a stable sort before publishing
    )
    # [END howto_operator_nats_publish_callable]

    @task
    def check(run: dict, generated: dict) -> None:
        assert (run["status"], run["acked"], run["failed"]) == ("complete", 3, 0), run
        assert (generated["status"], generated["acked"]) == ("complete", 6), generated
        assert run["high_water_marks"], run  # what a drain sensor waits for

    provision >> [publish, publish_generated]
    check(publish.output, publish_generated.output)


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
