"""Example DAG: move a group's partitions with NatsRebalanceOperator: take them away from a
member before its maintenance (cordon), then balance the group by measured load.

Needs a NATS server with JetStream (connection ``nats_default``) and workers of group
``GROUP`` running beside Airflow (``nats-ordered pool --stream STREAM --group GROUP ...``).
The member to cordon is the DAG param ``member`` when the run is given one (``airflow dags
trigger example_nats_rebalance --conf '{"member": "vm-2"}'``); otherwise the run picks one of
the group's live members (the last by id). Nothing here names a member id: the check
compares with what was cordoned, whatever ids the pool's members have (the system tests
run it against members ``worker-1``, ``worker-2`` and ``vm-1``, ``vm-2``).
docs/howto/rebalance.md quotes the marked parts.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Param, task
from airflow.sdk.exceptions import AirflowFailException

from airflow_nats_ordered.core import live_members
from airflow_nats_ordered.hooks.nats import NatsHook
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
    params={
        "member": Param(
            None,
            type=["null", "string"],
            description="member id to cordon, as `nats-ordered status` lists it; empty: "
            "one of the group's live members, picked when the run starts",
        )
    },
) as dag:
    # [START howto_operator_nats_rebalance_pick]
    @task
    def member_to_cordon(params: dict[str, Any] | None = None) -> list[str]:
        """The member to cordon: the run's ``member`` param, or one of the live members."""

        async def live(nc: Any) -> list[str]:
            return sorted(await live_members(nc, STREAM, GROUP))

        members = NatsHook().run(live)
        wanted = (params or {}).get("member")
        if wanted:
            return [wanted]  # the rebalance refuses an id the group does not know
        if len(members) < 2:
            raise AirflowFailException(
                f"group {GROUP} has {len(members)} live member(s) {members}: cordoning "
                "one needs another to take its partitions over"
            )
        return [members[-1]]

    picked = member_to_cordon()
    # [END howto_operator_nats_rebalance_pick]

    # [START howto_operator_nats_rebalance_cordon]
    cordon = NatsRebalanceOperator(
        task_id="cordon",
        stream=STREAM,
        group=GROUP,
        cordon=picked,  # member ids: a list, or a task's output as here
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
    def check(cordoned_ids: list[str], cordoned: dict, balanced: dict) -> None:
        """What was cordoned lost its partitions, and got a share back once lifted."""

        async def live(nc: Any) -> list[str]:
            return await live_members(nc, STREAM, GROUP)

        [member] = cordoned_ids
        assert member not in cordoned["owners"].values(), cordoned
        assert all(m["from"] == member for m in cordoned["moves"].values()), cordoned
        alive = NatsHook().run(live)
        if member in alive and len(alive) <= PARTITIONS:  # then every member owns some
            assert member in balanced["owners"].values(), balanced

    cordon >> by_load
    check(picked, cordon.output, by_load.output)


from system.utils import get_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_test_run(dag)
