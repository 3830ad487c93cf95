"""What Airflow's ``tests_common.test_utils.system_tests`` gives a provider's system tests,
for this repository (``tests_common`` is Airflow's own, unpublished test package).

``get_test_run(dag)`` has the interface and the assertion of Airflow's: it returns a test
function that pytest collects from the example module, which runs ``dag.test()`` and asserts
the DAG run ended in ``success``. One difference: Airflow 3.3's ``dag.test()`` looks the DAG
up in its DAG bundle (the ``dags-folder`` of the test session's AIRFLOW_HOME), so the test
copies the example file there for the run and removes it afterwards (the folder stays small,
and no other test's ``airflow dags reserialize`` registers an example's asset watchers).

``get_watcher_test_run(dag)`` is for examples scheduled on a ``nats`` asset watcher, which
``dag.test()`` cannot start: only a triggerer turns messages into asset events. Its test
parses the example file with a DagBag (no import error, the watcher's trigger is the nats
one) and then, for each watcher, publishes one keyed record to the watched stream and takes
the event from the trigger as the triggerer does (Airflow's SharedStreamManager in ack mode:
``NatsMessageTrigger.run()`` refuses outside it), checking the payload.

``get_parse_test(dag)`` only parses the example file (examples needing more than a NATS
server, such as Spark).

The connection ``nats_default`` and, for examples that name a ``GROUP``, the stream and a
pool of workers come from ``tests/system/conftest.py``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
import pytest

__all__ = ["get_parse_test", "get_test_run", "get_watcher_test_run"]


def _dags_folder() -> Path:
    from airflow_processes import airflow_home, metadata_db

    metadata_db()
    folder = airflow_home() / "dags"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def _in_dags_folder(dag: Any) -> Iterator[Path]:
    """The example's file, copied into the session's dags folder for the block."""
    source = Path(dag.fileloc)
    copy = _dags_folder() / f"system_{source.stem}_{uuid.uuid4().hex[:8]}.py"
    shutil.copyfile(source, copy)
    try:
        yield copy
    finally:
        copy.unlink(missing_ok=True)


def _parse(dag: Any) -> Any:
    """The example file's DAG as Airflow's DagBag imports it; fails on an import error."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=dag.fileloc)
    assert not bag.import_errors, bag.import_errors
    parsed = bag.dags.get(dag.dag_id)
    assert parsed is not None, f"{dag.fileloc} defines no DAG {dag.dag_id!r}"
    return parsed


def get_test_run(dag: Any, **test_kwargs: Any) -> Callable[[], None]:
    """A pytest test that runs ``dag.test(**test_kwargs)`` and asserts the run succeeded."""

    @pytest.mark.system
    def test_run() -> None:
        from airflow.utils.state import DagRunState

        _parse(dag)
        with _in_dags_folder(dag):
            dag_run = dag.test(**test_kwargs)
        states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
        assert dag_run.state == DagRunState.SUCCESS, (
            f"The system test failed: task states {states}; the task logs above say why"
        )

    return test_run


def get_parse_test(dag: Any) -> Callable[[], None]:
    """A pytest test that imports the example file with a DagBag (nothing is run)."""

    @pytest.mark.system
    def test_parse() -> None:
        parsed = _parse(dag)
        assert set(parsed.task_dict) == set(dag.task_dict)

    return test_parse


def nats_watchers(dag: Any) -> list[tuple[Any, Any]]:
    """``(asset, NatsMessageTrigger)`` for each nats watcher of the assets ``dag`` runs on."""
    from airflow.sdk import Asset

    from airflow_nats_ordered.triggers.messages import NatsMessageTrigger

    def assets(condition: Any) -> Iterator[Asset]:  # the leaves of AssetAll / AssetAny
        if isinstance(condition, Asset):
            yield condition
        for inner in getattr(condition, "objects", ()):
            yield from assets(inner)

    out = []
    for asset in assets(dag.timetable.asset_condition):
        for watcher in asset.watchers or ():
            trigger = getattr(watcher.trigger, "trigger", watcher.trigger)  # MessageQueueTrigger
            if isinstance(trigger, NatsMessageTrigger):
                out.append((asset, trigger))
    return out


def get_watcher_test_run(dag: Any, *, partitions: int = 1) -> Callable[[], None]:
    """A pytest test for an example DAG scheduled on nats asset watchers (see the module
    docstring): it parses, and each watcher's trigger makes an event of a published record.
    The watched stream is provisioned with ``partitions`` partitions if it does not exist."""

    @pytest.mark.system
    def test_run() -> None:
        from airflow_nats_ordered.triggers.messages import CLASSPATH

        parsed = _parse(dag)
        watchers = nats_watchers(dag)
        assert watchers, f"DAG {dag.dag_id} runs on no nats asset watcher"
        assert len(nats_watchers(parsed)) == len(watchers)
        for asset, trigger in watchers:
            assert trigger.serialize()[0] == CLASSPATH
            record = {"example": dag.dag_id, "asset": asset.uri, "id": uuid.uuid4().hex}
            payload = asyncio.run(_event_for_a_published_record(trigger, record, partitions))
            assert payload["stream"] == trigger.stream
            assert json.loads(payload["data"]) == record, payload
            assert payload["redeliveries"] == 0 and payload["stream_seq"] >= 1

    return test_run


async def _event_for_a_published_record(
    trigger: Any, record: dict[str, Any], partitions: int
) -> dict[str, Any]:
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
    from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
    from airflow_nats_ordered.hooks.nats import NatsHook

    options = await NatsHook(trigger.nats_conn_id).aget_options()
    nc = await nats.connect(servers=list(options.servers))
    try:
        await provision(nc, StreamSpec(trigger.stream, partitions=partitions))
        # the watcher reads from where its consumer is; a new one starts at deliver_policy
        key = trigger.shared_stream_key()
        manager = SharedStreamManager(ack_timeout=60)
        events = trigger.filter_shared_stream(
            manager.subscribe(trigger_id=1, trigger=trigger, key=key)
        )
        try:
            async with OrderedPublisher(nc, trigger.stream) as pub:
                await pub.publish(str(record["id"]), json.dumps(record).encode())
            async with asyncio.timeout(60):
                while True:  # what the triggerer does with each event: bind, persist, confirm
                    event = await anext(events)
                    seq = manager.bind_pending_event(trigger_id=1, key=key)
                    manager.confirm_persisted([seq])
                    if event.payload.get("data") == json.dumps(record):
                        return dict(event.payload)
        finally:
            await events.aclose()
            await manager.unsubscribe(1, key)
    finally:
        await nc.close()
