"""Example: a poison message starts a triage DAG run.

Workers of group ``GROUP`` running with ``poison="dead-letter"`` publish a message that
failed every retry to ``<prefix>.dlq.<group>.<partition>`` in stream ``<STREAM>_DLQ``.
The asset watcher below turns each one into an asset event (at least once: it is
acknowledged to JetStream only after Airflow stored the event), and every event
schedules a run of this DAG. The triage task logs why the message failed and where it
came from; replace it with what your team does (open a ticket, page, re-publish).

Equivalent without the helper::

    MessageQueueTrigger(scheme="nats", stream="ORDERS_DLQ", subject="orders.dlq.billing.*",
                        durable="airflow-dlq-billing", nats_conn_id="nats_default")

Importing this file needs no NATS server: the connection is opened by the triggerer.
"""

from __future__ import annotations

import base64
import json
import logging
import os

from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_nats_ordered.triggers.messages import dead_letter_trigger

STREAM = os.environ.get("NATS_ORDERED_DLQ_STREAM", "ORDERS")
GROUP = os.environ.get("NATS_ORDERED_DLQ_GROUP", "billing")

log = logging.getLogger(__name__)

dead_letters = Asset(
    name=f"dead_letters_{STREAM}_{GROUP}".lower(),
    uri=f"nats://{STREAM}_DLQ/{GROUP}",
    watchers=[
        AssetWatcher(
            name=f"dlq_{STREAM}_{GROUP}".lower(),
            trigger=dead_letter_trigger(STREAM, GROUP, nats_conn_id="nats_default"),
        )
    ],
)

with DAG(
    dag_id="nats_dead_letter_triage",
    schedule=[dead_letters],
    catchup=False,
    tags=["nats", "dead-letter"],
    doc_md=__doc__,
) as dag:

    @task
    def triage(triggering_asset_events=None) -> list[dict]:
        """Log each dead-lettered message: the error, its origin, its key and payload."""
        found = []
        for events in (triggering_asset_events or {}).values():
            for event in events:
                msg = (event.extra or {}).get("payload") or {}
                headers = msg.get("headers") or {}
                data = msg.get("data", "")
                if msg.get("data_encoding") == "base64":
                    data = base64.b64decode(data).decode("utf-8", "replace")
                origin = json.loads(headers.get("Nats-Ordered-Origin", "{}"))
                log.error(
                    "dead letter %s (DLQ seq %s): %s; origin %s, key %r, payload %.200s",
                    msg.get("subject"),
                    msg.get("stream_seq"),
                    headers.get("Nats-Ordered-Error", "?"),
                    origin,
                    headers.get("Nats-Ordered-Key"),
                    data,
                )
                found.append({"dlq_seq": msg.get("stream_seq"), "origin": origin})
        return found

    triage()
