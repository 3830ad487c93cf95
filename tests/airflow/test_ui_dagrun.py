"""The UI view's DAG run panel (``GET /nats-ordered/api/dagrun``): for a DAG run, what its
drain sensor waits on. A real DAG with a ``NatsGroupDrainSensor`` run by ``dag.test()`` in
the test session's metadata DB, which a real ``airflow api-server`` reads; the sensor waits
on a group that has state but no worker, so its partitions stay behind the marks it resolved
at its first poke. Poking (marks in the try's task state store) and deferred (marks in its
trigger's arguments): while it waits, the endpoint and the page (headless Chromium) show
its stream, group, marks and, per mark, the committed
position and exact lag, equal to what ``nats-ordered status --json`` says; then workers
drain the group, the sensor succeeds and the endpoint shows the marks from its XCom, none
behind. Requests without a token are refused (401)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from airflow_api import ApiServer
from airflow_dags import BackgroundPool, dag_file, nats_connection, on_server, task_states
from airflow_processes import metadata_db, query
from chromium import Browser, chromium_path
from locations import TESTS
from ui_auth import HIDDEN_DAG

from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig

GROUP = "g"
PARTITIONS = 3
RECORDS = 30
DEADLINE = 180.0

SENSOR = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    NatsGroupDrainSensor(
        task_id="drained", stream="{stream}", group="{group}", poke_interval=1,
        timeout=600, no_members_timeout=None, deferrable={deferrable},
    )
"""


def _config(stream: str) -> WorkerConfig:
    return WorkerConfig(stream, GROUP, member_id="af", lease_ttl=2.0, commit_interval=0.2)


def _behind(url: str, stream: str) -> None:
    """A group with state (a worker joined once, none now) and records it has not processed."""

    async def make(nc: Any) -> None:
        await provision(nc, StreamSpec(stream, partitions=PARTITIONS))
        await GroupStore.open(nc, _config(stream).group_config)
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(RECORDS):
                await pub.publish(f"k{i}", json.dumps({"i": i}).encode())

    on_server(url, make)


def _status(url: str, stream: str) -> dict:
    """``nats-ordered status --json`` for the group, as a user runs it."""
    r = subprocess.run(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "status", "--stream", stream]
        + ["--group", GROUP, "--json", "--server", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _run_id(dag_id: str) -> str | None:
    rows = query(metadata_db(), "SELECT run_id FROM dag_run WHERE dag_id = ?", dag_id)
    return rows[0][0] if rows else None


def _no_token(api: ApiServer, path: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(api.url + path, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _while_waiting(
    api: ApiServer, url: str, stream: str, dag_id: str, tmp_path: Any, waiting: tuple[str, str]
) -> None:
    """What the endpoint and the page show while the sensor waits (``waiting``: its state
    and where its marks are read from)."""
    deadline = time.monotonic() + DEADLINE
    while (run_id := _run_id(dag_id)) is None:
        assert time.monotonic() < deadline, "dag.test() made no DAG run"
        time.sleep(0.2)
    path = "/nats-ordered/api/dagrun?" + urlencode({"dag_id": dag_id, "run_id": run_id})
    while True:
        status, body = api.request("GET", path, user="viewer")
        assert status == 200, body
        [sensor] = body["sensors"]
        if (sensor["state"], sensor["marks_source"]) == waiting and sensor["wait"] is not None:
            break
        assert time.monotonic() < deadline, f"the sensor's marks never shown: {body}"
        time.sleep(0.5)
    st = _status(url, stream)
    assert (sensor["task_id"], sensor["stream"], sensor["group"]) == ("drained", stream, GROUP)
    assert sensor["connection_id"] == "nats_default", sensor
    # "now" at the first poke: every partition's last sequence then; nothing published since
    assert sensor["marks"] == {str(p["partition"]): p["last"] for p in st["partitions"]}
    wait = sensor["wait"]
    assert wait["group_exists"] and not wait["drained"] and wait["waiting_for"] == []
    got = [(m["partition"], m["committed"], m["lag_to_mark"]) for m in wait["marks"]]
    assert got == [(p["partition"], p["committed"], p["lag"]) for p in st["partitions"]]
    assert wait["behind"] == [p["partition"] for p in st["partitions"] if p["lag"] > 0]
    assert sum(m["lag_to_mark"] for m in wait["marks"]) == RECORDS == st["total_lag"]

    # refused without a token; an unknown run is named
    assert _no_token(api, path) == 401
    status, body = api.request("GET", f"/nats-ordered/api/dagrun?dag_id={dag_id}&run_id=nope")
    assert status == 404 and "nope" in body["detail"], body

    # the page, as a viewer signed in to Airflow
    with Browser(tmp_path) as browser:
        browser.set_cookie(api.url, "_token", api.token("viewer"))
        q = urlencode({"conn": "nats_default", "dag_id": dag_id, "run_id": run_id})
        browser.open(f"{api.url}/nats-ordered/?{q}")
        browser.wait_for(
            f"document.body.dataset.dagrun === '{dag_id}/{run_id}'", what="the DAG run panel"
        )
        rows = browser.evaluate(
            """[...document.querySelectorAll('#dagrun tr[data-sensor-mark]')].map(tr => {
                 const o = {};
                 tr.querySelectorAll('td[data-field]').forEach(td => {
                   if (td.dataset.field) o[td.dataset.field] = td.innerText.trim();
                 });
                 return o;
               })"""
        )
        assert rows == [
            {
                "partition": str(p["partition"]),
                "mark": str(p["last"]),
                "committed": str(p["committed"]),
                "lag_to_mark": str(p["lag"]),
                "behind": "yes" if p["lag"] else "no",
                "blocked": "no",
            }
            for p in st["partitions"]
        ], rows
        head = browser.evaluate(
            "[...document.querySelectorAll('#dagrun tr[data-sensor=\"drained\"] td')]"
            ".map(td => td.innerText)"
        )
        assert head[:5] == ["drained", waiting[0], stream, GROUP, waiting[1]], head
        shot = browser.screenshot(tmp_path / "ui-view-dagrun.png", down_to="#dagrun")
        print(f"\nscreenshot: {shot}", file=sys.__stderr__)


@pytest.mark.parametrize(
    ("deferrable", "waiting"),
    # dag.test() runs a deferred task's trigger in line and keeps the task instance queued
    # meanwhile (under a scheduler it is "deferred"); its trigger row holds the marks
    [(False, ("running", "task_state_store")), (True, ("queued", "trigger"))],
    ids=["poking", "deferred"],
)
def test_the_view_shows_what_a_dag_runs_drain_sensor_waits_on(
    nats_url, unique_name, tmp_path, monkeypatch, deferrable, waiting
):
    chromium_path()  # fails (not skips) without chromium, before minutes of set-up
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    _behind(nats_url, unique_name)
    errors: list[BaseException] = []
    pools: list[BackgroundPool] = []

    async def handler(msg: Any) -> None:
        pass

    # the api-server reads the metadata DB dag.test() writes (the test session's)
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{metadata_db()}"}
    with (
        ApiServer(tmp_path, env=env) as api,
        dag_file(SENSOR, stream=unique_name, group=GROUP, deferrable=deferrable) as dag,
    ):

        def watch() -> None:
            try:
                _while_waiting(api, nats_url, unique_name, dag.dag_id, tmp_path, waiting)
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:  # let the run finish either way
                pools.append(BackgroundPool(nats_url, _config(unique_name), handler).start())

        helper = threading.Thread(target=watch, daemon=True)
        helper.start()
        try:
            run = dag.test()
        finally:
            helper.join(DEADLINE + 120)
            for pool in pools:
                pool.stop()
        if errors:
            raise errors[0]
        assert task_states(run) == {"drained": "success"}, task_states(run)

        # finished: the marks from the sensor's XCom, none behind
        status, body = api.request(
            "GET",
            "/nats-ordered/api/dagrun?" + urlencode({"dag_id": dag.dag_id, "run_id": run.run_id}),
        )
        assert status == 200, body
        [sensor] = body["sensors"]
        assert (sensor["state"], sensor["marks_source"]) == ("success", "xcom"), sensor
        assert sensor["wait"]["drained"] and sensor["wait"]["behind"] == [], sensor
        assert all(m["committed"] >= m["mark"] for m in sensor["wait"]["marks"]), sensor


def test_a_dag_run_needs_the_permission_to_read_its_dag(tmp_path):
    """The view's read permission is not enough: a user whom the auth manager does not let
    read the DAG's task instances gets 403 for its runs, and still reads the rest."""
    env = {
        "AIRFLOW__CORE__AUTH_MANAGER": "ui_auth.HidingAuthManager",
        "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p),
    }
    with ApiServer(tmp_path, env=env) as api:
        hidden = "/nats-ordered/api/dagrun?" + urlencode({"dag_id": HIDDEN_DAG, "run_id": "r"})
        status, body = api.request("GET", hidden, user="viewer")
        assert status == 403, body
        status, body = api.request("GET", "/nats-ordered/api/connections", user="viewer")
        assert status == 200, body
        # another DAG, and the hidden one for an admin: allowed (no such run: 404)
        other = "/nats-ordered/api/dagrun?" + urlencode({"dag_id": "other", "run_id": "r"})
        status, body = api.request("GET", other, user="viewer")
        assert status == 404, body
        status, body = api.request("GET", hidden, user="admin")
        assert status == 404 and HIDDEN_DAG in body["detail"], body


def test_the_view_reads_the_key_and_class_the_sensor_writes():
    """The view names the sensor's task state store key and class without importing the
    sensor's module (Airflow's task SDK) into the api-server: they must stay the same."""
    from airflow_nats_ordered.plugins import dagrun
    from airflow_nats_ordered.sensors import drain

    assert dagrun.MARKS_KEY == drain.MARKS_KEY
    assert drain.NatsGroupDrainSensor.__name__ == dagrun.SENSOR
