"""The pipeline's operations DAGs, built by factories (the DAG files call them with the
settings from the environment; tests with their own stream and group):

* :func:`rebalance_dag` - ``group_rebalance``: every hour, rebalance the worker group by
  measured load (per-partition message rates over the last hour), skipped when the
  heaviest member's load would fall by less than ``min_gain``;
* :func:`triage_dag` - ``dead_letter_triage``: one run per poison message, started by the
  ``nats://`` AssetWatcher on the group's dead-letter subject; the task log shows the
  message, its error and its headers.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_nats_ordered.core.errors import KeyEncodingError
from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.operators.group import NatsRebalanceOperator
from airflow_nats_ordered.triggers.messages import dead_letter_trigger
from flights.settings import FlightsSettings

log = logging.getLogger(__name__)


def rebalance_dag(
    dag_id: str = "group_rebalance",
    settings: FlightsSettings | None = None,
    *,
    schedule: str | None = "@hourly",
    rate_window: float = 3600.0,
    min_gain: float = 0.10,
) -> DAG:
    """Rebalance ``settings.group`` by load every hour, skipping small gains."""
    s = settings or FlightsSettings.from_env()
    with DAG(
        dag_id=dag_id,
        schedule=schedule,
        start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        catchup=False,
        max_active_runs=1,
        tags=["nats", "operations"],
        doc_md=__doc__,
    ) as dag:
        NatsRebalanceOperator(
            task_id="rebalance_by_load",
            stream=s.stream,
            group=s.group,
            weights="rates",
            rate_window=rate_window,
            min_gain=min_gain,
            nats_conn_id=s.nats_conn_id,
        )
    return dag


def describe_dead_letter(payload: Mapping[str, Any]) -> dict[str, Any]:
    """What a triager needs from one ``nats://`` dead-letter event payload: where the
    message came from, why it failed, its key, headers and (decoded) data."""
    headers = dict(payload.get("headers") or {})
    data = payload.get("data", "")
    if payload.get("data_encoding") == "base64":
        data = base64.b64decode(data).decode("utf-8", "replace")
    try:
        key = message_key(headers)  # byte-exact, whichever header form carried it
    except KeyEncodingError as exc:  # why such a record was dead-lettered
        key = f"(malformed key: {exc})"
    return {
        "dlq_subject": payload.get("subject"),
        "dlq_seq": payload.get("stream_seq"),
        "error": headers.get("Nats-Ordered-Error", "?"),
        "origin": json.loads(headers.get("Nats-Ordered-Origin", "{}")),
        "key": key,
        "headers": headers,
        "data": data,
    }


def log_dead_letters(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Log each dead-lettered message (asset events carrying a ``payload``) and return
    what was logged."""
    found = []
    for event in events:
        d = describe_dead_letter((getattr(event, "extra", None) or {}).get("payload") or {})
        log.error(
            "dead letter %s (DLQ seq %s): %s\n  origin: %s\n  key: %r\n  headers: %s\n"
            "  message: %.2000s",
            d["dlq_subject"],
            d["dlq_seq"],
            d["error"],
            d["origin"],
            d["key"],
            json.dumps(d["headers"], sort_keys=True),
            d["data"],
        )
        found.append(d)
    return found


def dead_letter_asset(s: FlightsSettings) -> Asset:
    """The asset whose watcher turns each message dead-lettered by ``s.group`` into an
    asset event (``nats://<STREAM>_DLQ/<group>``)."""
    return Asset(
        name=f"dead_letters_{s.stream}_{s.group}".lower().replace("-", "_"),
        uri=f"nats://{s.stream}_DLQ/{s.group}",
        watchers=[
            AssetWatcher(
                name=f"dlq_{s.stream}_{s.group}".lower().replace("-", "_"),
                trigger=dead_letter_trigger(s.stream, s.group, nats_conn_id=s.nats_conn_id),
            )
        ],
    )


def triage_dag(dag_id: str = "dead_letter_triage", settings: FlightsSettings | None = None) -> DAG:
    """A run per message dead-lettered by ``settings.group`` (at least once: JetStream is
    acknowledged only after Airflow stored the asset event)."""
    s = settings or FlightsSettings.from_env()
    dead_letters = dead_letter_asset(s)
    with DAG(
        dag_id=dag_id,
        schedule=[dead_letters],
        catchup=False,
        tags=["nats", "dead-letter"],
        doc_md=__doc__,
    ) as dag:

        @task
        def triage(triggering_asset_events: Any = None) -> list[dict]:
            """Show each poison message, its error and headers in this task's log."""
            events = [e for evs in (triggering_asset_events or {}).values() for e in evs]
            return log_dead_letters(events)

        triage()
    return dag
