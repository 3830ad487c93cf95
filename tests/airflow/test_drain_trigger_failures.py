"""A deferred drain sensor fails at once only for what a retry cannot fix (issue 16 item 4):
the trigger's error event says whether a retry may get through, and the sensor obeys it."""

from __future__ import annotations

import asyncio

import pytest
from airflow_dags import nats_connection

from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor
from airflow_nats_ordered.triggers.drain import NatsGroupDrainTrigger


async def _event(conn_id: str, stream: str) -> dict:
    trigger = NatsGroupDrainTrigger(
        stream=stream, group="g", marks={"0": 1}, nats_conn_id=conn_id, timeout=120
    )
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger fired no event")


def test_an_unreachable_server_is_retried_and_a_missing_stream_fails_at_once(
    monkeypatch, nats_url, unique_name
):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    nobody = f"nats://127.0.0.1:{free_port()}"  # no server listens there
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DOWN", nats_connection(nobody))
    monkeypatch.setenv("AIRFLOW_CONN_NATS_UP", nats_connection(nats_url))
    down = asyncio.run(_event("nats_down", "ORDERS"))
    missing = asyncio.run(_event("nats_up", unique_name))  # never provisioned
    assert down["status"] == missing["status"] == "error", (down, missing)
    assert down["retryable"] is True and missing["retryable"] is False, (down, missing)

    sensor = NatsGroupDrainSensor(task_id="drained", stream="S", group="g", deferrable=True)
    with pytest.raises(AirflowException) as err:
        sensor.execute_complete({}, down)
    # a server that did not answer may answer on the next try: not AirflowFailException
    assert not isinstance(err.value, AirflowFailException), err.value
    assert "could not connect" in str(err.value)
    with pytest.raises(AirflowFailException, match=unique_name):
        sensor.execute_complete({}, missing)
