"""NatsSparkPublishOperator against a real Spark standalone cluster (a master and a worker
started with ``spark-class`` on 127.0.0.1, client deploy mode) and a token-protected
nats-server (issue 16 item 2): the executors, started by the worker without any NATS
environment, publish with the connection the driver resolved, and the token shows on no
process command line, in no executor's environment, in no Spark event log and no XCom."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow_dags import dag_file, task_states
from streamcheck import read_stream

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.embedded.servers import NatsServer

pytest.importorskip("pyspark")

TOKEN = "tok-standalone-7c1f9e2ab4"
ROWS = 30
BIN = Path(sys.executable).parent

APP = """
import argparse, json
from pyspark.sql import SparkSession
from airflow_nats_ordered.spark import write_ordered

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int)
p.add_argument("--stream")
p.add_argument("--producer-id")
a = p.parse_args()
spark = SparkSession.builder.appName("nats-standalone-test").getOrCreate()
df = spark.createDataFrame([(f"k{i % 5}", i) for i in range(a.rows)], "k string, n long")
rec = write_ordered(df, stream=a.stream, key="k", order_by="n", producer_id=a.producer_id)
print(json.dumps({"status": rec.status, "acked": rec.acked}))
spark.stop()
"""

DAG = """
import datetime as dt
import json
from airflow.sdk import DAG, task
from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator

@task
def keep(record):
    with open({out!r}, "w") as f:
        json.dump(record, f)

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2013, 1, 1)) as dag:
    publish = NatsSparkPublishOperator(
        task_id="publish", application={app!r}, stream="{stream}", producer_id="standalone.1",
        application_args=["--rows", "{rows}"],
        conf={conf!r},
    )
    keep(publish.output)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any NATS_* variable: what a cluster's processes have."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env.update(
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        **extra,
    )
    return env


def _alive_workers(webui: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=5) as resp:
        state = json.load(resp)
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


class Cluster:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = _free_port()
        self.webui = _free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def master(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        self.procs.append(
            subprocess.Popen(
                [str(BIN / "spark-class"), *args],
                env=_clean_env(SPARK_LOG_DIR=str(self.work), SPARK_WORKER_DIR=str(self.work)),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()

    def start(self) -> None:
        self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.webui),
        )
        self._spawn(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.master,
            "--host",
            "127.0.0.1",
            "--cores",
            "1",
            "--memory",
            "1g",
            "--webui-port",
            str(_free_port()),
            "--work-dir",
            str(self.work / "work"),
        )
        deadline = time.monotonic() + 180
        while True:
            try:
                if _alive_workers(self.webui) >= 1:
                    return
            except OSError:
                pass
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = {
                    n: (self.work / f"{n}.log").read_text()[-2000:] for n in ("master", "worker")
                }
                raise RuntimeError(f"no ALIVE worker (exited: {dead}); logs: {logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("standalone"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


class Watch(threading.Thread):
    """Reads every process's command line (and the environment of Spark executors) while
    the job runs: where the token was seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.seen: set[str] = set()
        self.executors = 0

    def run(self) -> None:
        token = TOKEN.encode()
        while not self.stop.is_set():
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmd = (proc / "cmdline").read_bytes()
                    if token in cmd:
                        self.seen.add(f"command line of {cmd[:200]!r}")
                    if b"CoarseGrainedExecutorBackend" in cmd:
                        self.executors += 1
                        if token in (proc / "environ").read_bytes():
                            self.seen.add("an executor's environment")
                except OSError:
                    continue
            self.stop.wait(0.2)


def _on_token_server(url: str, fn: Any) -> Any:
    import asyncio

    async def go() -> Any:
        nc = await connect(ConnectionOptions(servers=(url,), token=TOKEN))
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.mark.slow  # its own spark-submit JVMs for 1.5 min: make test-slow, one at a time
def test_operator_on_a_standalone_cluster_publishes_with_the_drivers_connection(
    cluster, monkeypatch, tmp_path, unique_name, capfd
):
    config = f'authorization {{ token: "{TOKEN}" }}'
    with NatsServer(tmp_path / "nats", extra_config=config) as server:
        _on_token_server(
            server.url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=2))
        )
        conn = {"conn_type": "nats", "extra": {"servers": server.url, "token": TOKEN}}
        monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", json.dumps(conn))
        spark_conn = {
            "conn_type": "spark",
            "host": cluster.master,
            "extra": {"deploy-mode": "client"},
        }
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(spark_conn))
        for var in [v for v in os.environ if v.startswith("NATS_")]:
            monkeypatch.delenv(var)
        app = tmp_path / "app.py"
        app.write_text(APP)
        events = tmp_path / "events"
        events.mkdir()
        conf = {
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "512m",
            "spark.cores.max": "1",
            "spark.eventLog.enabled": "true",
            "spark.eventLog.compress": "false",
            "spark.eventLog.dir": events.as_uri(),
        }
        out = tmp_path / "record.json"
        watch = Watch()
        watch.start()
        try:
            with dag_file(
                DAG, app=str(app), stream=unique_name, rows=ROWS, conf=conf, out=str(out)
            ) as dag:
                run = dag.test(logical_date=dt.datetime(2024, 6, 1, tzinfo=dt.UTC))
        finally:
            watch.stop.set()
            watch.join(30)
        logs = capfd.readouterr()
        states = task_states(run)

        async def facts(nc: Any) -> Any:
            rec = await (await RunLedger.open(nc, unique_name)).get("standalone.1")
            return rec, await read_stream(nc, unique_name)

        rec, got = _on_token_server(server.url, facts)
    assert states == {"publish": "success", "keep": "success"}, (states, logs.out[-3000:])
    assert rec is not None and rec.status == "complete" and rec.acked == ROWS
    assert sorted(json.loads(s.data)["n"] for s in got) == list(range(ROWS))
    # the tasks ran on the cluster's executors, not in the driver
    assert watch.executors > 0 and list((cluster.work / "work").glob("app-*/*/stderr"))
    pushed = out.read_text()
    assert json.loads(pushed)["acked"] == ROWS
    logged = b"".join(p.read_bytes() for p in events.rglob("*") if p.is_file())
    assert b"SparkListenerEnvironmentUpdate" in logged  # what the UI's Environment tab shows
    where = sorted(watch.seen)
    for path in [*events.rglob("*"), *(cluster.work / "work").rglob("*")]:
        if path.is_file() and TOKEN.encode() in path.read_bytes():
            where.append(str(path))
    if TOKEN in pushed:
        where.append("XCom")
    if TOKEN in logs.out + logs.err:
        where.append("task output")
    assert where == [], f"the token was seen in: {where}"
