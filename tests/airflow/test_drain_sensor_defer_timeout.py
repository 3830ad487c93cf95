"""The deferrable drain sensor gives Airflow its deadline when it defers (issue 30, defect
4): it called ``defer()`` without ``timeout``, so the task instance's ``trigger_timeout``
stayed NULL and the scheduler, which fails a deferred task past that column whether or not
a triggerer runs (``check_trigger_timeouts``), never enforced the sensor's ``timeout``
while the triggerer was down. It now passes what is left of its ``timeout``, as Airflow's
own deferrable sensors do. Real nats-server, real metadata DB (``dag.test()``)."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from datetime import timedelta

import pytest
from airflow.sdk.exceptions import TaskDeferred
from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states
from airflow_processes import metadata_db, query

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

TIMEOUT = 600  # the sensor's timeout: far beyond what any wait below needs
DEADLINE = 90.0


def _config(stream: str) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="af", lease_ttl=2.0, commit_interval=0.2)


def _behind(url: str, stream: str) -> None:
    """A group that has existed (no member now) and records it has not processed."""

    async def make(nc) -> None:
        await provision(nc, StreamSpec(stream, partitions=2))
        await GroupStore.open(nc, _config(stream).group_config)
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(20):
                await pub.publish(f"k{i}", json.dumps({"i": i}).encode())

    on_server(url, make)


def test_the_sensor_defers_with_what_is_left_of_its_timeout(nats_url, unique_name, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    _behind(nats_url, unique_name)
    sensor = NatsGroupDrainSensor(
        task_id="drained", stream=unique_name, group="g", deferrable=True, timeout=TIMEOUT
    )
    started = time.monotonic()
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    spent = time.monotonic() - started
    timeout = deferred.value.timeout
    assert isinstance(timeout, timedelta), f"defer() got timeout={timeout!r}"
    # what is left: the first check's time is taken off, nothing is added
    assert TIMEOUT - spent - 1 <= timeout.total_seconds() <= TIMEOUT, (timeout, spent)
    # the trigger keeps the same deadline (its timeout counts from the same start)
    trigger = deferred.value.trigger
    assert trigger.timeout == TIMEOUT and trigger.started <= time.time()


def test_a_sensor_with_no_real_deadline_defers_without_one():
    """A timeout of centuries (``timeout=float(10**12)``) would overflow the date Airflow
    stores: no deadline then, as before."""
    sensor = NatsGroupDrainSensor(
        task_id="drained", stream="S", group="g", deferrable=True, timeout=float(10**12)
    )
    assert sensor._defer_timeout(time.time()) is None


SENSOR = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", deferrable=True,
        timeout={timeout}, no_members_timeout=60,
    )
"""


def _trigger_timeout(dag_id: str) -> dt.datetime | None:
    rows = query(
        metadata_db(),
        "SELECT trigger_timeout FROM task_instance WHERE dag_id = ? AND task_id = 'drained'",
        dag_id,
    )
    if not rows or rows[0][0] is None:
        return None
    value = dt.datetime.fromisoformat(str(rows[0][0]))
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def test_the_deferred_task_instance_has_the_sensors_deadline_in_the_metadata_db(
    nats_url, unique_name, monkeypatch
):
    """While the trigger waits (no worker yet), the task instance's ``trigger_timeout`` is
    the sensor's deadline; then workers start and the sensor succeeds."""
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    _behind(nats_url, unique_name)
    seen: list[tuple[dt.datetime, dt.datetime]] = []  # (trigger_timeout, when read)
    errors: list[BaseException] = []
    pools: list[BackgroundPool] = []

    async def handler(msg) -> None:
        pass

    with dag_file(SENSOR, stream=unique_name, timeout=TIMEOUT) as dag:

        def watch() -> None:
            try:
                deadline = time.monotonic() + DEADLINE
                while (found := _trigger_timeout(dag.dag_id)) is None:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"the deferred sensor's trigger_timeout stayed NULL for {DEADLINE:g}s"
                        )
                    time.sleep(0.2)
                seen.append((found, dt.datetime.now(dt.UTC)))
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:  # let the run finish either way
                pools.append(BackgroundPool(nats_url, _config(unique_name), handler).start())

        helper = threading.Thread(target=watch, daemon=True)
        helper.start()
        try:
            run = dag.test()
        finally:
            helper.join(DEADLINE + 60)
            for pool in pools:
                pool.stop()
    if errors:
        raise errors[0]
    assert task_states(run) == {"drained": "success"}, task_states(run)
    [(trigger_timeout, read_at)] = seen
    left = (trigger_timeout - read_at).total_seconds()
    # set at the deferral to what was left of the 600 s: under 600 s from when it was read,
    # and far more than the generous bound on how long the run took to get there
    assert TIMEOUT - DEADLINE - 60 < left <= TIMEOUT, (trigger_timeout, read_at)
