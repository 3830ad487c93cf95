"""Example DAG: start a DAG run per JetStream message with NatsMessageTrigger in an asset
watcher (event-driven scheduling, at least once into asset events).

Needs a NATS server with JetStream (connection ``nats_default``), the stream, a triggerer and
the scheduler. ``dag.test()`` cannot start this DAG (only a triggerer turns messages into
asset events): the system test parses the file and checks that the watcher's trigger makes
an event of a published record (tests/system/utils.py). docs/howto/message-trigger.md quotes
the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_nats_ordered.triggers.messages import NatsMessageTrigger

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_message_trigger"
STREAM = f"EXAMPLE_WATCH_{ENV_ID}"
PARTITIONS = 2

# [START howto_trigger_nats_message]
orders = Asset(
    f"nats://{STREAM}/orders",
    watchers=[
        AssetWatcher(
            name="orders_watcher",
            trigger=NatsMessageTrigger(
                stream=STREAM,
                subject=f"{STREAM.lower()}.p.>",  # every partition of a provisioned stream
            ),
        )
    ],
)

with DAG(
    dag_id=DAG_ID,
    schedule=[orders],
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:

    @task
    def handle(triggering_asset_events=None) -> list[int]:
        """One asset event per message; its payload says where it was stored."""
        seqs = []
        for events in (triggering_asset_events or {}).values():
            for event in events:
                payload = event.extra["payload"]
                print(payload["subject"], payload["stream_seq"], payload["data"])
                seqs.append(payload["stream_seq"])  # the key to drop a duplicate by
        return seqs

    handle()
# [END howto_trigger_nats_message]


from system.utils import get_watcher_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_watcher_test_run(dag, partitions=PARTITIONS)
