"""Example DAG: the ``nats`` scheme of common-messaging's MessageQueueTrigger in an asset
watcher; it becomes a NatsMessageTrigger, so a DAG written against MessageQueueTrigger
(as for Kafka or SQS) reads JetStream with the same guarantee.

Needs a NATS server with JetStream (connection ``nats_default``), the stream, a triggerer and
the scheduler. ``dag.test()`` cannot start this DAG (only a triggerer turns messages into
asset events): the system test parses the file and checks that the watcher's trigger makes
an event of a published record (tests/system/utils.py). docs/howto/message-queue.md quotes
the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_queue"
STREAM = f"EXAMPLE_QUEUE_{ENV_ID}"
PARTITIONS = 2

# [START howto_queue_nats]
trigger = MessageQueueTrigger(
    scheme="nats",
    stream=STREAM,
    subject=f"{STREAM.lower()}.p.>",
    nats_conn_id="nats_default",
)
orders = Asset(
    f"nats://{STREAM}/orders",
    watchers=[AssetWatcher(name="orders_queue_watcher", trigger=trigger)],
)

with DAG(
    dag_id=DAG_ID,
    schedule=[orders],
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats"],
) as dag:

    @task
    def handle(triggering_asset_events=None) -> int:
        events = [e for evs in (triggering_asset_events or {}).values() for e in evs]
        for event in events:
            print(event.extra["payload"]["data"])
        return len(events)

    handle()
# [END howto_queue_nats]


from system.utils import get_watcher_test_run  # noqa: E402

# pytest runs it (docs/howto/index.md: system tests)
test_run = get_watcher_test_run(dag, partitions=PARTITIONS)
