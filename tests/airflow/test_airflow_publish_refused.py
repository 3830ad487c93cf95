"""NatsPublishOperator whose stream is repartitioned while it feeds records (issue 28 item 2),
in a real DAG run (``dag.test()``, a real metadata DB and nats-server): its first try ends,
failed with the repartition named, instead of spinning for ever; its retry resumes the run
(same producer id, same input) on the new layout and completes it, each record stored once
and each key in input order. (The task's whole run is under pytest-timeout: before the
fix the first try never returned.)"""

from __future__ import annotations

import json

from airflow_dags import dag_file, nats_connection, on_server, task_states
from streamcheck import read_stream

from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for

PIPELINE = """
import asyncio
import datetime as dt
import threading

import nats
from airflow.sdk import DAG
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.operators.publish import NatsPublishOperator

KEYS = [f"k{{i}}" for i in range(12)]
LATE = [k for k in KEYS if partition_for(k, 4) in (0, 1)]


def switch_once(url, stream):
    # the stream's first layout only: a retry reads the same input without switching again
    async def go():
        nc = await nats.connect(url)
        try:
            if (await describe(nc, stream)).partitions == 4:
                await repartition(nc, stream, 8)
        finally:
            await nc.close()

    t = threading.Thread(target=asyncio.run, args=(go(),))
    t.start()
    t.join(120)


def rows(url, stream):
    for i in range(48):  # every partition of 4; publish() waits for their acks (max_pending)
        yield {{"k": KEYS[i % 12], "i": i}}
    for i in range(48, 56):  # partitions 0 and 1 only: 2 and 3 are acked, batches open
        yield {{"k": LATE[i % len(LATE)], "i": i}}
    switch_once(url, stream)
    for i in range(56, 64):
        yield {{"k": LATE[i % len(LATE)], "i": i}}


retry = {{"retries": 1, "retry_delay": dt.timedelta(0)}}
with DAG(
    dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1), default_args=retry
) as dag:
    NatsPublishOperator(
        task_id="publish", stream="{stream}", key_field="k", producer_id="af-refused",
        records_callable=rows, op_kwargs={{"url": "{url}", "stream": "{stream}"}},
        # acks for every record (flow 1), few held: the lanes are idle with open batches
        # (linger 30 s) when the stream switches, so 2 and 3 are refused committing them
        publisher_config={{"linger": 30.0, "max_in_flight": 2, "max_pending": 4}},
    )
"""


def _want() -> dict[str, list[int]]:
    keys = [f"k{i}" for i in range(12)]
    late = [k for k in keys if partition_for(k, 4) in (0, 1)]
    order = [keys[i % 12] for i in range(48)] + [late[i % len(late)] for i in range(48, 64)]
    want: dict[str, list[int]] = {}
    for i, k in enumerate(order):
        want.setdefault(k, []).append(i)
    return want


def test_a_publish_task_refused_by_a_repartition_fails_and_its_retry_completes_the_run(
    nats_url, unique_name, monkeypatch, capfd
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    on_server(nats_url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=4)))
    with dag_file(PIPELINE, stream=unique_name, url=nats_url) as dag:
        run = dag.test()
    out = capfd.readouterr()
    log = out.out + out.err
    states = task_states(run)
    (ti,) = run.get_task_instances()
    assert states == {"publish": "success"} and ti.try_number == 2, (states, ti.try_number)
    assert "was repartitioned to 8 partitions (epoch 1)" in log  # the first try's failure

    async def read(nc):
        rec = await (await RunLedger.open(nc, unique_name)).get("af-refused")
        return rec, await read_stream(nc, unique_name)

    rec, stored = on_server(nats_url, read)
    assert rec is not None and rec.status == "complete" and rec.epoch == 1, rec
    assert rec.attempts == 2 and rec.before_switch["epoch"] == 0
    got: dict[str, list[int]] = {}
    for m in stored:
        got.setdefault(m.key, []).append(json.loads(m.data)["i"])
    assert len(stored) == 64 and got == _want(), got
