"""``nats://`` asset URIs are validated and normalised by the provider's ``asset-uris`` handler
(issue 16 item 6): before, ``Asset("nats://")`` silently became the asset ``nats:/`` and a
server address or a dotted name passed as a stream. The test builds real ``Asset`` objects, so
the handler is the one Airflow finds through its providers manager."""

from __future__ import annotations

import pytest
from airflow.sdk import Asset


def test_the_provider_registers_the_nats_handler_with_airflow() -> None:
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    from airflow_nats_ordered.assets.nats import sanitize_uri

    assert ProvidersManagerTaskRuntime().asset_uri_handlers.get("nats") is sanitize_uri


@pytest.mark.parametrize(
    "given,uri",
    [
        ("nats://ORDERS", "nats://ORDERS/"),  # the identity Airflow gave it before the handler
        ("NATS://ORDERS/", "nats://ORDERS/"),
        ("nats://FLIGHTS_DLQ/aircraft-totals", "nats://FLIGHTS_DLQ/aircraft-totals"),
        ("nats://Orders-v2/billing/", "nats://Orders-v2/billing"),  # stream case kept
    ],
)
def test_a_stream_uri_is_accepted_and_normalised(given: str, uri: str) -> None:
    asset = Asset(given)
    assert asset.uri == uri
    assert asset.normalized_uri == uri


@pytest.mark.parametrize(
    "given,why",
    [
        ("nats://", r"names no stream \(Airflow read it as 'nats:/'\): use nats://<STREAM>"),
        ("nats:ORDERS", "names no stream.*did you mean nats://ORDERS\\?"),
        ("nats:///ORDERS/billing", "did you mean nats://ORDERS/billing\\?"),
        ("nats://127.0.0.1:4222/ORDERS", "names a server address, not a stream.*nats_conn_id"),
        ("nats://nats-1:4222", "server address"),
        ("nats://alice@ORDERS", "must not hold credentials \\(it held a user name.*nats_conn_id"),
        (
            "nats://alice:Sekr3t-pw@ORDERS/x",
            r"'nats://ORDERS/x' must not hold credentials \(it held a user and a password",
        ),
        ("nats://:Sekr3t-pw@ORDERS", "must not hold credentials"),
        ("nats://orders.eu/x", "'orders.eu' is not a JetStream stream name"),
        ("nats://ORD*ERS", "not a JetStream stream name"),
    ],
)
def test_a_malformed_uri_is_refused_saying_what_to_write(given: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        Asset(given)
    assert "nats://<STREAM>[/<path>], e.g. nats://ORDERS" in str(info.value)
    assert "Sekr3t" not in str(info.value) and "alice" not in str(info.value)


def test_credentials_are_refused_whatever_the_asset_is_named() -> None:
    # Airflow drops a password from the URI before the handler runs (a warning only), and
    # would keep the URI as written as the asset's name
    with pytest.raises(ValueError, match="must not hold credentials") as info:
        Asset(name="orders", uri="nats://alice:Sekr3t-pw@ORDERS")
    assert "Sekr3t" not in str(info.value)


def test_a_dag_file_with_a_malformed_nats_asset_fails_its_import_saying_why(tmp_path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "bad_nats_asset.py").write_text(
        "from airflow.sdk import DAG, Asset\n"
        "with DAG('bad_nats_asset', schedule=[Asset('nats://')]):\n"
        "    pass\n"
    )
    bag = DagBag(dag_folder=str(tmp_path))
    (error,) = bag.import_errors.values()
    assert "nats asset URI names no stream" in error and "nats://<STREAM>" in error


PASSWORD = "Sekr3t-pw-4711"
CREDENTIALS_DAG = f"""
import datetime as dt
from airflow.sdk import DAG, Asset

with DAG(
    "nats_asset_with_password",
    schedule=[Asset("nats://alice:{PASSWORD}@ORDERS/billing")],
    start_date=dt.datetime(2024, 1, 1),
):
    pass
"""


# a real dag-processor parsing a DAG file (about 1 min): make test-slow
@pytest.mark.slow
def test_a_dag_parsed_by_the_dag_processor_with_credentials_in_a_nats_uri_fails_its_import(
    tmp_path,
) -> None:
    """The real dag-processor parses the file once, on its own home and metadata DB: the
    import error it stores names the problem, and neither it, the DB's assets and DAGs, the
    processor's output nor its per-file log hold the password. Before, the DAG was stored
    with the asset named ``nats://alice:<password>@ORDERS/billing``."""
    import subprocess

    from airflow_processes import AIRFLOW, airflow_env, private_home, query

    env, db = private_home(tmp_path / "home")
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "nats_asset_with_password.py").write_text(CREDENTIALS_DAG)
    env |= {"AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    run = subprocess.run(
        [AIRFLOW, "dag-processor", "--num-runs", "1"],
        env=airflow_env(env), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ((filename, stacktrace),) = query(db, "SELECT filename, stacktrace FROM import_error")
    assert filename == "nats_asset_with_password.py"
    assert "nats asset URI 'nats://ORDERS/billing' must not hold credentials" in stacktrace
    assert "the credentials belong in the nats connection (nats_conn_id)" in stacktrace
    assert query(db, "SELECT dag_id FROM dag") == []
    stored = [str(row) for table in ("asset", "import_error", "dag_warning", "serialized_dag")
              for row in query(db, f"SELECT * FROM {table}")]  # fmt: skip
    logs = [p.read_text(errors="replace") for p in (tmp_path / "home").rglob("*.log")]
    assert logs, "the dag-processor wrote no per-file log"
    for text in (*stored, run.stdout, run.stderr, *logs):
        assert PASSWORD not in text
