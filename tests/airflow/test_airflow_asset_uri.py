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
        ("nats://alice@ORDERS", "must not hold credentials.*nats_conn_id"),
        ("nats://orders.eu/x", "'orders.eu' is not a JetStream stream name"),
        ("nats://ORD*ERS", "not a JetStream stream name"),
    ],
)
def test_a_malformed_uri_is_refused_saying_what_to_write(given: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        Asset(given)
    assert "nats://<STREAM>[/<path>], e.g. nats://ORDERS" in str(info.value)


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
