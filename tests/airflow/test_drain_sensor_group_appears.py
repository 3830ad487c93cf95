"""The drain sensor started before the group's workers (issue 15 items 4 and 15): a group
with no state yet is waited for, not failed in 0.1 s with "no state yet". A real DAG run
(``dag.test()``, deferrable, the trigger run in-process), a real nats-server and a real
worker pool started only once the sensor has resolved its marks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states
from airflow_processes import metadata_db, query

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.sensors.drain import MARKS_KEY

SENSOR = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="g", timeout=120, no_members_timeout=60,
        deferrable=True,
    )
"""

N = 60
DEADLINE = 60.0


async def _streams(nc):
    for info in await nc.jetstream().streams_info():
        yield info


def _wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {DEADLINE:g}s waiting for {what}")
        time.sleep(0.1)


def _marks_resolved(dag_id: str) -> bool:
    """The sensor's first poke resolved its "now" marks (kept in its task state store)."""
    return bool(
        query(
            metadata_db(),
            "SELECT 1 FROM task_state_store WHERE dag_id = ? AND task_id = 'drained' AND key = ?",
            dag_id,
            MARKS_KEY,
        )
    )


def test_the_sensor_waits_for_a_group_whose_workers_start_after_it(
    nats_url, unique_name, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    async def stream_without_group(nc) -> bool:
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(N):
                await pub.publish(f"k{i % 7}", json.dumps({"i": i}).encode())
        buckets = [s.config.name async for s in _streams(nc)]
        return f"KV_{GroupConfig(unique_name, 'g').state_bucket}" in buckets

    assert on_server(nats_url, stream_without_group) is False
    seen: list[int] = []
    pools: list[BackgroundPool] = []
    errors: list[BaseException] = []
    cfg = WorkerConfig(unique_name, "g", member_id="af", lease_ttl=2.0, commit_interval=0.2)

    with dag_file(SENSOR, stream=unique_name) as dag:

        def start_workers_later() -> None:
            try:
                _wait_for("the sensor's first poke", lambda: _marks_resolved(dag.dag_id))
                handler = lambda msg: seen.append(json.loads(msg.data)["i"])  # noqa: E731
                pools.append(BackgroundPool(nats_url, cfg, handler, size=1).start())
            except BaseException as exc:  # reported below
                errors.append(exc)

        helper = threading.Thread(target=start_workers_later, daemon=True)
        helper.start()
        try:
            run = dag.test()
        finally:
            helper.join(DEADLINE)
            for pool in pools:
                pool.stop()
    assert not errors, errors
    assert task_states(run) == {"drained": "success"}, task_states(run)
    assert sorted(set(seen)) == list(range(N)), "the sensor succeeded before the work"
