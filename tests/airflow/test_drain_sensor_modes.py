"""The drain sensor's "now" marks are resolved once per try and kept, in every mode (issue 13
item 2): real DAG runs (``dag.test()``, which runs a reschedule-mode sensor's pokes as
separate task runs with reschedules recorded in the metadata DB), a real nats-server and a
real worker pool that starts only after more messages were published behind the marks."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states
from airflow_processes import metadata_db, query

from airflow_nats_ordered.core.admin.drain import read_lag
from airflow_nats_ordered.core.group.store import GroupStore
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
        task_id="drained", stream="{stream}", group="g", deferrable={deferrable},
        mode="{mode}", poke_interval={poke_interval}, timeout=90,
    )
"""

BEFORE = 40  # records in the stream when the sensor starts (i < BEFORE)
AFTER = 30  # records published once the sensor has resolved its marks
DEADLINE = 60.0


def _config(stream: str) -> WorkerConfig:
    # a commit after every message: a handler paused on a later record leaves every record
    # before it committed
    return WorkerConfig(
        stream, "g", member_id="af", lease_ttl=2.0, commit_interval=0.2, commit_every=1
    )


def _publish(url: str, stream: str, start: int, n: int) -> None:
    async def go(nc) -> None:
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(start, start + n):
                await pub.publish(f"k{i % 13}", json.dumps({"i": i}).encode())

    on_server(url, go)


def _last_seqs(url: str, stream: str) -> dict[str, int]:
    async def go(nc) -> dict[str, int]:
        lag = await read_lag(nc, stream, "g")
        return {str(p.partition): p.last for p in lag.partitions}

    return on_server(url, go)


def _setup(url: str, stream: str) -> dict[str, int]:
    """The stream, a group that has existed (no member now), BEFORE records; their marks."""

    async def make(nc) -> None:
        await provision(nc, StreamSpec(stream, partitions=4))
        await GroupStore.open(nc, _config(stream).group_config)

    on_server(url, make)
    _publish(url, stream, 0, BEFORE)
    return _last_seqs(url, stream)


def _wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {DEADLINE:g}s waiting for {what}")
        time.sleep(0.1)


def _reschedules(dag_id: str) -> int:
    return query(
        metadata_db(),
        "SELECT count(*) FROM task_reschedule r JOIN task_instance t ON r.ti_id = t.id "
        "WHERE t.dag_id = ? AND t.task_id = 'drained'",
        dag_id,
    )[0][0]


def _kept_marks(dag_id: str) -> dict | None:
    """The record the sensor keeps in its task state store, as stored."""
    rows = query(
        metadata_db(),
        "SELECT value FROM task_state_store WHERE dag_id = ? AND task_id = 'drained' AND key = ?",
        dag_id,
        MARKS_KEY,
    )
    return json.loads(rows[0][0]) if rows else None


class PausedAfter:
    """A handler that processes records with ``i < BEFORE`` and pauses (alive, owning its
    partition, committing nothing more) on any later one until ``release()``."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.seen_when_done: list[int] = []  # what was processed when the sensor finished
        self.gate = threading.Event()

    async def __call__(self, msg) -> None:
        i = json.loads(msg.data)["i"]
        while i >= BEFORE and not self.gate.is_set():
            await asyncio.sleep(0.05)
        self.seen.append(i)

    def release(self) -> None:
        self.gate.set()


class Helper(threading.Thread):
    """Runs ``steps`` beside ``dag.test()``; ``finish()`` re-raises what failed in it."""

    def __init__(self, steps: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.steps = steps
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.steps()
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.join(DEADLINE)
        if self.error is not None:
            raise self.error


def _run_with_late_messages(
    url: str,
    stream: str,
    mode: str,
    marks_resolved: Callable[[str], bool],
    deferrable: bool = False,
) -> tuple[dict, dict, PausedAfter, list[BackgroundPool]]:
    """A DAG run of the sensor: once ``marks_resolved(dag_id)``, AFTER more records are
    published and a worker pool starts that pauses on them. Returns the task states, the
    sensor's XCom, the handler and the pool (to stop)."""
    handler = PausedAfter()
    pools: list[BackgroundPool] = []
    source = SENSOR.replace("{deferrable}", str(deferrable))
    with dag_file(source, stream=stream, mode=mode, poke_interval=1) as dag:

        def between_pokes() -> None:
            _wait_for("the sensor's first poke", lambda: marks_resolved(dag.dag_id))
            _publish(url, stream, BEFORE, AFTER)
            pools.append(BackgroundPool(url, _config(stream), handler, size=1).start())

        helper = Helper(between_pokes)
        helper.start()
        try:
            run = dag.test()
            handler.seen_when_done = list(handler.seen)
        finally:
            handler.release()
            helper.finish()
        xcom = run.get_task_instances()[0].xcom_pull(task_ids="drained")
    return task_states(run), xcom, handler, pools


def _stop(pools: list[BackgroundPool]) -> None:
    for pool in pools:
        pool.stop()


def test_reschedule_mode_waits_for_the_marks_of_its_first_poke_not_later_messages(
    nats_url, unique_name, monkeypatch
):
    """The issue: every reschedule-mode poke took new "now" marks (3501 -> 3529 after 50
    more messages), so the sensor chased the tail. The later messages are never processed
    while the sensor waits: it must succeed on the marks of its first poke."""
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    first = _setup(nats_url, unique_name)
    states, xcom, handler, pools = _run_with_late_messages(
        nats_url, unique_name, "reschedule", lambda dag_id: _reschedules(dag_id) >= 1
    )
    try:
        assert states == {"drained": "success"}, (
            f"{states}: the sensor waited for messages published after its first poke"
        )
        assert xcom["marks"] == first, (xcom, first)
        assert _last_seqs(nats_url, unique_name) != first, "no message came after the marks"
        assert sorted(handler.seen_when_done) == list(range(BEFORE)), "drained too early"
    finally:
        _stop(pools)


def test_poke_mode_waits_for_the_marks_of_its_first_poke_not_later_messages(
    nats_url, unique_name, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    first = _setup(nats_url, unique_name)
    states, xcom, handler, pools = _run_with_late_messages(
        nats_url, unique_name, "poke", lambda dag_id: _kept_marks(dag_id) is not None
    )
    try:
        assert states == {"drained": "success"}, states
        assert xcom["marks"] == first, (xcom, first)
        assert _last_seqs(nats_url, unique_name) != first, "no message came after the marks"
        assert sorted(handler.seen_when_done) == list(range(BEFORE)), "drained too early"
    finally:
        _stop(pools)


def test_deferrable_mode_waits_for_the_marks_of_its_first_poke_not_later_messages(
    nats_url, unique_name, monkeypatch
):
    """The trigger gets the marks the first poke resolved, never "now"."""
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    first = _setup(nats_url, unique_name)
    states, xcom, handler, pools = _run_with_late_messages(
        nats_url,
        unique_name,
        "poke",
        lambda dag_id: _kept_marks(dag_id) is not None,
        deferrable=True,
    )
    try:
        assert states == {"drained": "success"}, states
        assert xcom["status"] == "success" and xcom["marks"] == first, (xcom, first)
        assert _last_seqs(nats_url, unique_name) != first, "no message came after the marks"
        assert sorted(handler.seen_when_done) == list(range(BEFORE)), "drained too early"
    finally:
        _stop(pools)


def test_a_rescheduled_poke_that_lost_its_kept_marks_fails_instead_of_taking_new_ones(
    nats_url, unique_name, monkeypatch, capfd
):
    """If the record of the first poke is gone (deleted, expired), a later poke of the same
    try cannot know its marks: resolving "now" again would wait for later messages, so it
    fails and says that a new try resolves fresh marks."""
    from airflow.models.task_state_store import TaskStateStoreModel
    from airflow.utils.session import create_session
    from sqlalchemy import delete

    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    _setup(nats_url, unique_name)
    source = SENSOR.replace("{deferrable}", "False")
    with dag_file(source, stream=unique_name, mode="reschedule", poke_interval=1) as dag:

        def lose_the_record() -> None:
            _wait_for("the sensor's first poke", lambda: _reschedules(dag.dag_id) >= 1)
            with create_session() as session:
                session.execute(
                    delete(TaskStateStoreModel).where(
                        TaskStateStoreModel.dag_id == dag.dag_id,
                        TaskStateStoreModel.key == MARKS_KEY,
                    )
                )
            _publish(nats_url, unique_name, BEFORE, AFTER)

        helper = Helper(lose_the_record)
        helper.start()
        try:
            run = dag.test()
        finally:
            helper.finish()
    out = capfd.readouterr()
    assert task_states(run) == {"drained": "failed"}, task_states(run)
    assert "are gone from its task state store" in out.out + out.err
    assert _kept_marks(dag.dag_id) is None, "a later poke resolved and kept new marks"


def _clear_when_rescheduled(dag_id: str) -> bool:
    """Clear the sensor (a new try) if it is waiting for its next poke; False if it is not
    (it is poking now: try again)."""
    from airflow.models.taskinstance import TaskInstance, clear_task_instances
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    with create_session() as session:
        tis = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id, TaskInstance.task_id == "drained"
            )
        ).all()
        if [ti.state for ti in tis] != [TaskInstanceState.UP_FOR_RESCHEDULE]:
            return False
        clear_task_instances(list(tis), session, dag_run_state=False)
    return True


def test_a_cleared_sensor_resolves_fresh_marks_in_its_new_try(nats_url, unique_name, monkeypatch):
    """Try 1 keeps the marks of its first poke; a clear starts try 2, which must resolve new
    ones (the kept record of try 1 is still in the task state store, and must not be used)."""
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    first = _setup(nats_url, unique_name)
    handler = PausedAfter()
    handler.release()  # the new try waits for the later messages too: process everything
    pools: list[BackgroundPool] = []
    source = SENSOR.replace("{deferrable}", "False")
    with dag_file(source, stream=unique_name, mode="reschedule", poke_interval=1) as dag:
        kept_by_try_1: list[dict] = []

        def clear_between_pokes() -> None:
            _wait_for("try 1's first poke", lambda: _reschedules(dag.dag_id) >= 1)
            kept_by_try_1.append(_kept_marks(dag.dag_id) or {})
            _publish(nats_url, unique_name, BEFORE, AFTER)
            _wait_for(
                "the sensor waiting between pokes", lambda: _clear_when_rescheduled(dag.dag_id)
            )
            pools.append(BackgroundPool(nats_url, _config(unique_name), handler, size=1).start())

        helper = Helper(clear_between_pokes)
        helper.start()
        try:
            run = dag.test()
        finally:
            helper.finish()
        ti = run.get_task_instances()[0]
        xcom = ti.xcom_pull(task_ids="drained")
    try:
        later = _last_seqs(nats_url, unique_name)
        assert task_states(run) == {"drained": "success"}, task_states(run)
        assert ti.try_number == 2, f"the clear did not start a new try (try {ti.try_number})"
        assert kept_by_try_1[0].get("marks") == first, kept_by_try_1
        assert later != first
        assert xcom["marks"] == later, f"try 2 waited for {xcom['marks']}, not {later}"
        assert sorted(handler.seen) == list(range(BEFORE + AFTER))
        kept = _kept_marks(dag.dag_id)
        assert kept is not None and kept["try_number"] == 2 and kept["marks"] == later, kept
    finally:
        _stop(pools)
