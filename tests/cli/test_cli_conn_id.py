"""`--conn-id`: every command can take its NATS connection from an Airflow connection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from locations import TESTS

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.embedded.servers import NatsServer

PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    config = f'authorization {{ user: alice, password: "{PASSWORD}" }}'
    with NatsServer(tmp_path_factory.mktemp("conn-id"), extra_config=config) as server:
        yield server


def _define(monkeypatch, conn_id: str, **fields) -> None:
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "nats", **fields})
    )


def test_commands_take_server_and_credentials_from_the_airflow_connection(
    auth_server, unique_name, monkeypatch, capsys
):
    _define(
        monkeypatch,
        "nats_auth",
        host="127.0.0.1",
        port=auth_server.port,
        login="alice",
        password=PASSWORD,
    )
    # the NATS_* variables are not what connects (they would fail: no credentials)
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    args = ["--stream", unique_name, "--conn-id", "nats_auth"]
    assert cli(["provision", *args, "--partitions", "2"]) == 0
    capsys.readouterr()
    assert cli(["info", *args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stream"] == unique_name
    # without the connection the same server refuses us
    monkeypatch.delenv("NATS_URL")
    assert cli(["info", "--stream", unique_name, "--server", auth_server.url]) == 2
    assert PASSWORD not in capsys.readouterr().err


def test_worker_runs_with_an_airflow_connection_from_the_environment(
    auth_server, unique_name, tmp_path
):
    url_fields = {"host": f"127.0.0.1:{auth_server.port}", "login": "alice", "password": PASSWORD}
    env = dict(
        os.environ,
        PYTHONPATH=str(TESTS),
        AIRFLOW_CONN_NATS_DEFAULT=json.dumps({"conn_type": "nats", **url_fields}),
    )
    base = [sys.executable, "-m", "airflow_nats_ordered.cli"]
    subprocess.run(
        [*base, "provision", "--stream", unique_name, "--partitions", "1", "--conn-id"]
        + ["nats_default"],
        env=env,
        check=True,
        capture_output=True,
    )
    proc = subprocess.Popen(
        [*base, "worker", "--stream", unique_name, "--group", "g", "--conn-id", "nats_default"]
        + ["--handler", "chaos_handlers:ignore", "--member-id", "af"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert "member af joined group g" in line, line + proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert PASSWORD not in err


def test_an_undefined_connection_is_named_with_how_to_add_it(monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_CONN", raising=False)
    assert cli(["info", "--stream", "S", "--conn-id", "no_such_conn"]) == 2
    err = capsys.readouterr().err
    assert "Airflow connection 'no_such_conn' is not defined" in err
    assert "AIRFLOW_CONN_NO_SUCH_CONN" in err and "airflow connections add" in err


def test_a_malformed_connection_names_the_connection_and_the_field(monkeypatch, capsys):
    _define(monkeypatch, "nats_bad", host="127.0.0.1", extra={"tls_cafile": "/x.pem"})
    assert cli(["info", "--stream", "S", "--conn-id", "nats_bad"]) == 2
    err = capsys.readouterr().err
    assert "Airflow connection 'nats_bad'" in err and "tls_cafile" in err


def test_conn_id_refuses_connection_flags_beside_it(capsys):
    code = cli(["info", "--stream", "S", "--conn-id", "x", "--server", "nats://h:4222"])
    assert code == 2
    assert "drop --server" in capsys.readouterr().err


def test_conn_id_without_airflow_says_to_install_it_or_use_flags():
    # a process in which `import airflow` fails, as where Airflow is not installed
    code = (
        "import sys; sys.modules['airflow'] = None\n"
        "from airflow_nats_ordered.cli import main\n"
        "sys.exit(main(['info', '--stream', 'S', '--conn-id', 'nats_default']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--conn-id nats_default reads an Airflow connection, but Airflow cannot be" in r.stderr
    assert "pip install 'airflow-nats-ordered[airflow]'" in r.stderr
    assert "--server" in r.stderr
