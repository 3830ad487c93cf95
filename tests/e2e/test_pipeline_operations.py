"""The pipeline's DAG files import as Airflow loads them, ``group_rebalance`` moves load and
then skips a small gain, and ``dead_letter_triage`` logs what a real worker dead-lettered."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from types import SimpleNamespace

import nats
from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states
from locations import ROOT

from airflow_nats_ordered.core.group.assignor import Assignment
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.triggers.messages import NatsMessageTrigger

DAGS = ROOT / "dags"
if str(DAGS) not in sys.path:
    sys.path.insert(0, str(DAGS))

from flights.handlers import AircraftTotals  # noqa: E402
from flights.operations import dead_letter_asset, triage_dag  # noqa: E402
from flights.settings import FlightsSettings  # noqa: E402


def test_the_dags_folder_loads_every_pipeline_dag_without_errors(monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("AIRCRAFT_TOTALS_DB", "/nonexistent/totals.db")  # read only when run
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    assert {"flights_ordered_pipeline", "group_rebalance", "dead_letter_triage"} <= set(bag.dag_ids)
    pipeline = bag.dags["flights_ordered_pipeline"]
    assert pipeline.max_active_runs == 1 and pipeline.catchup
    publish = pipeline.get_task("publish")
    assert publish.depends_on_past and publish.wait_for_downstream


REBALANCE = """# an airflow DAG file
import sys
sys.path.insert(0, {dags!r})
from flights.operations import rebalance_dag
from flights.settings import FlightsSettings

dag = rebalance_dag("{dag_id}", FlightsSettings(stream="{stream}", group="g"), schedule=None,
                    rate_window=600, min_gain=0.1)
"""


def test_group_rebalance_balances_by_load_then_skips_a_small_gain(
    nats_url, unique_name, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    config = WorkerConfig(unique_name, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2)

    async def setup(nc) -> None:
        await provision(nc, StreamSpec(unique_name, partitions=8))
        await GroupStore.open(nc, config.group_config)

    async def load_one_member(nc) -> None:
        """All the load on two partitions of the same member: a rebalance by load helps."""
        data, _ = await (await GroupStore.attach(nc, unique_name, "g")).read_assignment()
        owners = Assignment.from_json(data).owners
        member = owners[0]
        hot = [p for p, m in owners.items() if m == member][:2]
        keys = {}
        for i in range(10_000):
            keys.setdefault(partition_for(f"k{i}", 8), f"k{i}")
        async with OrderedPublisher(nc, unique_name) as pub:
            for i in range(400):
                await pub.publish(keys[hot[i % 2]], b"{}")

    async def handler(msg) -> None:
        pass

    on_server(nats_url, setup)
    with (
        BackgroundPool(nats_url, config, handler, size=2),
        dag_file(REBALANCE, dags=str(DAGS), stream=unique_name) as dag,
    ):
        on_server(nats_url, load_one_member)
        first = dag.test()
        moved = first.get_task_instance("rebalance_by_load").xcom_pull(task_ids="rebalance_by_load")
        second = dag.test()
    assert task_states(first) == {"rebalance_by_load": "success"}, task_states(first)
    assert moved["imbalance_after"] <= moved["imbalance_before"], moved
    assert task_states(second) == {"rebalance_by_load": "skipped"}, "balanced: nothing to gain"


def test_dead_letter_triage_logs_the_poison_message_its_error_and_headers(
    nats_url, unique_name, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    settings = FlightsSettings(stream=unique_name, group="aircraft-totals")

    async def dead_letter() -> dict:
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        async with OrderedPublisher(nc, unique_name) as pub:
            await pub.publish("N14228", b'{"flight_id": "UA1545", "distance": 1400}')
            await pub.publish("N14228", b"{not json")
        cfg = WorkerConfig(
            unique_name,
            settings.group,
            member_id="m1",
            max_retries=0,
            lease_ttl=2,
            batch_handler=True,
        )
        handler = AircraftTotals(stream=unique_name, group=settings.group, path=tmp_path / "t.db")
        worker = Worker(nc, cfg, handler, on_assign=handler.on_assign)
        await worker.start()
        try:
            async with asyncio.timeout(30):
                while worker.stats["dead_lettered"] < 1:
                    await asyncio.sleep(0.05)
        finally:
            await worker.stop()
            handler.close()
            await nc.close()
        dag = triage_dag("triage_test", settings)
        asset = dead_letter_asset(settings)
        [watcher] = asset.watchers
        producer = NatsMessageTrigger.create_shared_stream_producer(watcher.trigger.serialize()[1])
        try:
            async with asyncio.timeout(20):
                payload, _ = await anext(producer.open_stream())
        finally:
            await producer.aclose()
        return dag, asset, payload

    dag, asset, payload = asyncio.run(dead_letter())
    triage = dag.get_task("triage")
    with caplog.at_level(logging.ERROR):
        [shown] = triage.python_callable(
            triggering_asset_events={asset: [SimpleNamespace(extra={"payload": payload})]}
        )
    assert shown["data"] == "{not json" and shown["key"] == "N14228"
    assert shown["origin"]["group"] == settings.group
    logged = caplog.text
    assert "{not json" in logged and "N14228" in logged
    assert "JSONDecodeError" in logged or "Expecting property name" in logged, logged
    assert "Nats-Ordered-Origin" in logged and "Nats-Msg-Id" in logged, "headers not shown"
    assert json.loads(payload["headers"]["Nats-Ordered-Origin"])["stream"] == unique_name
