"""``--conn-id`` finds a connection stored in Airflow's metadata database (issue 15 item 6):
one added with a real ``airflow connections add``, as the docs say, read by ``nats-ordered``
processes on that Airflow home against a real nats-server that requires the connection's
password. Airflow 3's SDK lookup outside a task asks only variables and secrets backends,
so these commands said "not defined: add it" right after the user had added it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from airflow_processes import airflow, airflow_env, private_home

from airflow_nats_ordered.embedded.servers import NatsServer

PASSWORD = "db-s3cret-pw"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    config = f'authorization {{ user: carol, password: "{PASSWORD}" }}'
    with NatsServer(tmp_path_factory.mktemp("conn-id-db"), extra_config=config) as server:
        yield server


def _nats_ordered(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "airflow_nats_ordered.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# real `airflow db migrate` and `airflow connections add` processes (1-1.5 min): test-slow
@pytest.mark.slow
def test_conn_id_reads_a_connection_added_with_airflow_connections_add(
    tmp_path: Path, auth_server, unique_name
):
    home_env, _db = private_home(tmp_path / "airflow")
    airflow(
        "connections",
        "add",
        "nats_in_db",
        "--conn-type",
        "nats",
        "--conn-host",
        f"127.0.0.1:{auth_server.port}",
        "--conn-login",
        "carol",
        "--conn-password",
        PASSWORD,
        env=home_env,
    )
    env = airflow_env(home_env)
    for var in [v for v in env if v.startswith(("NATS_", "AIRFLOW_CONN_"))]:
        del env[var]
    env["NATS_URL"] = "nats://127.0.0.1:1"  # not what connects: the connection is
    common = ["--stream", unique_name, "--conn-id", "nats_in_db"]
    made = _nats_ordered(env, "provision", *common, "--partitions", "2")
    assert made.returncode == 0, made.stdout + made.stderr
    info = _nats_ordered(env, "info", *common, "--json")
    assert info.returncode == 0, info.stdout + info.stderr
    assert json.loads(info.stdout)["stream"] == unique_name
    for r in (made, info):
        assert PASSWORD not in r.stdout + r.stderr

    # a connection in neither place is still "not defined", naming how to add it
    missing = _nats_ordered(env, "info", "--stream", unique_name, "--conn-id", "nats_nowhere")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "Airflow connection 'nats_nowhere' is not defined" in missing.stderr
    assert "airflow connections add nats_nowhere" in missing.stderr


def test_conn_id_says_why_the_metadata_database_was_not_read(tmp_path: Path, unique_name):
    env = airflow_env(
        {
            "AIRFLOW_HOME": str(tmp_path),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'never-migrated.db'}",
        }
    )
    for var in [v for v in env if v.startswith("AIRFLOW_CONN_")]:
        del env[var]
    r = _nats_ordered(env, "info", "--stream", unique_name, "--conn-id", "nats_default")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Airflow connection 'nats_default' is not defined" in r.stderr, r.stderr
    assert "metadata database was not read" in r.stderr and "airflow db migrate" in r.stderr
