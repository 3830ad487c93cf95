"""Example DAG: move a group's partitions with NatsRebalanceOperator: take them away from a
member before its maintenance (cordon), then balance the group by measured load.

Needs a NATS server with JetStream (connection ``nats_default``) and workers of group
``GROUP`` running beside Airflow (``nats-ordered pool``; the system tests start two, members
``worker-1`` and ``worker-2``, see tests/system/conftest.py). docs/howto/rebalance.md quotes
the marked parts.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_nats_ordered.operators.group import NatsRebalanceOperator

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_rebalance"
STREAM = f"EXAMPLE_REBALANCE_{ENV_ID}"
PARTITIONS = 4
GROUP = "billing"

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:
    # [START howto_operator_nats_rebalance_cordon]
    cordon = NatsRebalanceOperator(
        task_id="cordon",
        stream=STREAM,
        group=GROUP,
        cordon=["worker-2"],  # member ids, as `nats-ordered status` lists them
    )
    # [END howto_operator_nats_rebalance_cordon]

    # [START howto_operator_nats_rebalance]
    by_load = NatsRebalanceOperator(
        task_id="by_load",
        stream=STREAM,
        group=GROUP,
        weights="rates",  # messages/s per partition, measured by the server
        rate_window=600,  # over the last 10 minutes
    )
    # [END howto_operator_nats_rebalance]

    @task
    def check(cordoned: dict, balanced: dict) -> None:
        assert "worker-2" not in cordoned["owners"].values(), cordoned
        assert set(balanced["owners"].values()) == {"worker-1", "worker-2"}, balanced

    cordon >> by_load
    check(cordon.output, by_load.output)


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
