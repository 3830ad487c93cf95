"""Errors no retry can fix fail the task at once; errors a retry may fix are retried
(issue 16 item 4). Real DAG runs (``dag.test()``, a real metadata DB, a real nats-server):
every task has ``retries=2`` and no retry delay, so a task whose error is retried ends
failed at its third try, and one failed at once ends failed at its first."""

from __future__ import annotations

import socket

from airflow_dags import dag_file, nats_connection, on_server, task_states

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

FAILURES = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

retry = {{"retries": 2, "retry_delay": dt.timedelta(0)}}
with DAG(
    dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1), default_args=retry
) as dag:
    NatsPublishOperator(
        task_id="refused", stream="{stream}", key_field="k",
        records=[{{"k": "a", "i": 0}}, {{"i": 1}}],
    )
    NatsPublishOperator(
        task_id="missing_stream", stream="{stream}_MISSING", key_field="k", records=[{{"k": "a"}}]
    )
    NatsPublishOperator(
        task_id="partition_mismatch", stream="{stream}", key_field="k", records=[{{"k": "a"}}],
        expected_partitions=3,
    )
    NatsPublishOperator(
        task_id="bad_option", stream="{stream}", key_field="k", records=[{{"k": "a"}}],
        publisher_config={{"max_inflight": 10}},
    )
    NatsProvisionStreamOperator(task_id="conflict", stream="{stream}", partitions=8)
    NatsGroupDrainSensor(
        task_id="drain_missing_stream", stream="{stream}_MISSING", group="g", deferrable=True
    )
    NatsPublishOperator(
        task_id="unreachable", stream="{stream}", key_field="k", records=[{{"k": "a"}}],
        nats_conn_id="nats_nowhere",
    )
"""


def _free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unfixable_errors_fail_at_once_and_transient_ones_are_retried(
    nats_url, unique_name, monkeypatch, capfd
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    nowhere = f"nats://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("AIRFLOW_CONN_NATS_NOWHERE", nats_connection(nowhere))

    async def make(nc) -> None:
        await provision(nc, StreamSpec(unique_name, partitions=4))

    on_server(nats_url, make)
    with dag_file(FAILURES, stream=unique_name) as dag:
        run = dag.test()
    out = capfd.readouterr()
    log = out.out + out.err
    states = task_states(run)
    tries = {ti.task_id: ti.try_number for ti in run.get_task_instances()}
    assert set(states.values()) == {"failed"}, states
    failed_at_once = [line for line in log.splitlines() if "AirflowFailException: " in line]
    unfixable = {  # task -> what its first and only try said
        "refused": "1 records were refused before sending (record 2: no key)",
        "missing_stream": f"stream {unique_name}_MISSING does not exist",
        "partition_mismatch": "has 4 partitions in its metadata but 3 were expected",
        "bad_option": "publisher_config has unknown setting(s) max_inflight",
        "conflict": "has 4 partitions in its metadata but 8 were requested",
        "drain_missing_stream": f"stream {unique_name}_MISSING does not exist",
    }
    for task, said in unfixable.items():
        assert tries[task] == 1, f"{task} was retried: {tries}"
        assert any(said in line for line in failed_at_once), f"{task}: {said!r} not in the log"
    # the fix in the operator's terms (its parameter), not only in a CLI flag's
    assert "or request partitions=4 (CLI: --partitions 4)" in log
    # a server nobody answers on may answer at the next try: both retries were used
    assert tries["unreachable"] == 3, tries
    assert "could not connect to" in log
