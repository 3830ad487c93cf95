"""NatsSparkPublishOperator: a real spark-submit of spark_apps/publish_flights.py in a
``dag.test()`` run, and the settings it refuses before submitting anything."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path

import pytest
from airflow_dags import dag_file, nats_connection, task_states
from authfixtures import new_nkey
from locations import ROOT
from spark_helpers import make_stream, run_record, stored

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.hooks.nats import NatsHook

pytest.importorskip("pyspark")

from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator  # noqa: E402
from airflow_nats_ordered.spark import SinkOptions, write_ordered  # noqa: E402

APP = str(ROOT / "spark_apps" / "publish_flights.py")
LOCAL_SPARK = json.dumps({"conn_type": "spark", "host": "local[2]"})

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
        task_id="publish", application={app!r}, stream="{stream}",
        application_args=["--start", "2013-01-02", "--allow-refused"],
        conf={{"spark.ui.enabled": "false"}},
    )
    keep(publish.output)
"""


# spark-submit through the operator, its own JVM (about 1-2 min): make test-slow
@pytest.mark.slow
def test_spark_publish_task_pushes_the_runs_marks_from_the_ledger(
    nats_url, unique_name, monkeypatch, tmp_path
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", LOCAL_SPARK)
    make_stream(nats_url, unique_name, partitions=4)
    out = tmp_path / "record.json"
    when = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
    with dag_file(DAG, app=APP, stream=unique_name, out=str(out)) as dag:
        run = dag.test(logical_date=when)
        states = task_states(run)
        pushed = json.loads(out.read_text())
        # the same run cleared and run again: the ledger says complete, no job is submitted
        again = task_states(dag.test(logical_date=when))
        repushed = json.loads(out.read_text())
    assert states == {"publish": "success", "keep": "success"}, states
    assert again == states and repushed["already_complete"] is True
    assert repushed["high_water_marks"] == pushed["high_water_marks"]
    rec = run_record(nats_url, unique_name, pushed["producer_id"])
    assert rec is not None and rec.status == "complete"
    # a submitted job begins an attempt in the ledger: one attempt means the re-run submitted none
    assert rec.attempts == 1, (
        f"the complete run's job was submitted again ({rec.attempts} attempts)"
    )
    assert pushed["producer_id"].startswith(f"{dag.dag_id}.publish.")
    assert {int(p): s for p, s in pushed["high_water_marks"].items()} == rec.high_water_marks
    got = stored(nats_url, unique_name)
    assert len(got) == rec.acked > 800 and max(s.seq for s in got) == max(
        rec.high_water_marks.values()
    )


def _operator(**kw) -> NatsSparkPublishOperator:
    return NatsSparkPublishOperator(
        task_id="publish", application=APP, stream="S", producer_id="run-1", **kw
    )


def test_nats_credentials_reach_the_driver_as_env_never_on_the_command_line(monkeypatch):
    conn = {
        "conn_type": "nats",
        "extra": {"servers": "nats://127.0.0.1:4222", "token": "tok-never-shown-42"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", LOCAL_SPARK)
    op = _operator()
    op.prepare("run-1")
    command = op._get_hook()._build_spark_submit_command(APP)
    assert not any("tok-never-shown-42" in part for part in command), command
    assert op.env_vars["NATS_TOKEN"] == "tok-never-shown-42"
    assert op.env_vars["PYSPARK_PYTHON"] == sys.executable
    assert op.env_vars["PATH"].startswith(str(Path(sys.executable).parent))
    assert op.conf["spark.speculation"] == "false"
    assert command[-4:] == ["--stream", "S", "--producer-id", "run-1"]


@pytest.mark.parametrize(
    "auth",
    [
        {"login": "bob", "password": "pw-never-shown-7"},
        {"extra": {"nkey_seed_secret": new_nkey().seed}},
    ],
    ids=["login", "nkey_seed_secret"],
)
def test_every_field_of_the_nats_connection_reaches_the_driver(monkeypatch, auth):
    """Issue 16 item 2: tls_hostname, tls_verify, connect_timeout, name and the reconnect
    settings never reached the driver (only the URL and the secret), and an inline nkey
    seed was refused. The driver's sink now resolves what the hook resolves."""
    extra = {
        "servers": "tls://127.0.0.1:4443",
        "tls_hostname": "nats.internal",
        "tls_verify": False,
        "connect_timeout": 2.5,
        "name": "flights-spark",
        "max_reconnect_attempts": 9,
        "reconnect_time_wait": 1.25,
        **auth.get("extra", {}),
    }
    conn = {"conn_type": "nats", **{k: v for k, v in auth.items() if k != "extra"}, "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", LOCAL_SPARK)
    op = _operator()
    op.prepare("run-1")
    command = " ".join(op._get_hook()._build_spark_submit_command(APP))
    want = NatsHook().get_options()
    for var in [v for v in os.environ if v.startswith("NATS_")]:
        monkeypatch.delenv(var)
    for var, value in op.env_vars.items():
        if var.startswith("NATS_"):
            monkeypatch.setenv(var, value)
    got = SinkOptions.from_spark({"stream": "S", "keyColumn": "k", "producerId": "run-1"})
    assert got.connection_options() == want
    for secret in (want.password, want.nkey_seed):
        assert secret is None or secret not in command


@pytest.mark.parametrize(
    ("spark_conn", "kw"),
    [
        ({"conn_type": "spark", "host": "yarn"}, {}),
        ({"conn_type": "spark", "host": "k8s://https://k8s.example:6443"}, {}),
        ({"conn_type": "spark", "host": "spark://127.0.0.1:7077"}, {"deploy_mode": "cluster"}),
    ],
)
def test_modes_that_turn_env_into_conf_are_refused_before_submitting(monkeypatch, spark_conn, kw):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection("nats://127.0.0.1:4222"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(spark_conn))
    with pytest.raises(ConfigError, match="--conf"):
        _operator(**kw).prepare("run-1")


def test_speculation_is_refused(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection("nats://127.0.0.1:4222"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", LOCAL_SPARK)
    with pytest.raises(ConfigError, match="speculation"):
        _operator(conf={"spark.speculation": "true"}).prepare("run-1")


BLANK_ID_DAG = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2013, 1, 1)) as dag:
    NatsSparkPublishOperator(
        task_id="publish", application={app!r}, stream="{stream}",
        producer_id="{{{{ params.get('run_id', '') }}}}",  # renders empty: nothing passed
        application_args=["--start", "2013-01-02"], conf={{"spark.ui.enabled": "false"}},
    )
"""


def test_a_producer_id_that_renders_empty_is_refused_not_replaced_by_the_default(
    nats_url, unique_name, monkeypatch, capfd
):
    """An empty id used to fall back to the default (``self.producer_id or default``): a
    template that renders empty then publishes under an id nobody passed."""
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", LOCAL_SPARK)
    make_stream(nats_url, unique_name, partitions=2)
    with dag_file(BLANK_ID_DAG, app=APP, stream=unique_name) as dag:
        run = dag.test(logical_date=dt.datetime(2024, 5, 2, tzinfo=dt.UTC))
    out = capfd.readouterr()
    assert task_states(run) == {"publish": "failed"}
    assert "NatsSparkPublishOperator 'publish': producer_id is empty" in out.out + out.err
    assert stored(nats_url, unique_name) == []  # no job was submitted


def test_write_ordered_refuses_an_empty_producer_id_naming_the_parameter(spark):
    df = spark.createDataFrame([("k", 1)], "k string, v long")
    with pytest.raises(ConfigError, match=r"^producer_id is empty \(' '\)"):
        write_ordered(df, stream="NOPE", key="k", producer_id=" ")  # no server is asked
