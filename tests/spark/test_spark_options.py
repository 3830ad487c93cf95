"""The sink's options (no SparkSession needed) and the pyspark packaging."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from airflow_nats_ordered.core.errors import ConfigError

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import SinkOptions  # noqa: E402

BASE = {"stream": "FLIGHTS", "keyColumn": "tailnum", "producerId": "run-1"}


@pytest.mark.parametrize(
    ("option", "env"),
    [
        ("password", "NATS_PASSWORD"),
        ("token", "NATS_TOKEN"),
        ("creds", "NATS_CREDS"),
        ("nkeySeed", "NATS_NKEY"),
        ("tlsKey", "NATS_KEY"),
    ],
)
def test_secrets_are_refused_as_options_and_never_echoed(option, env):
    with pytest.raises(ConfigError) as err:
        SinkOptions.from_spark({**BASE, option: "s3cr3t-value"})
    assert env in str(err.value) and "s3cr3t-value" not in str(err.value)


def test_credentials_in_the_url_option_are_refused_and_never_echoed():
    with pytest.raises(ConfigError, match="NATS_USER/NATS_PASSWORD") as err:
        SinkOptions.from_spark({**BASE, "url": "nats://me:pw-9876@127.0.0.1:4222"})
    assert "pw-9876" not in str(err.value)


def test_secrets_come_from_the_environment_and_url_from_the_option(monkeypatch):
    monkeypatch.setenv("NATS_URL", "nats://elsewhere:4222")
    monkeypatch.setenv("NATS_TOKEN", "tok-123")
    opts = SinkOptions.from_spark({**BASE, "URL": "nats://127.0.0.1:5222", "orderBy": "a, b"})
    conn = opts.connection_options()
    assert conn.servers == ("nats://127.0.0.1:5222",) and conn.token == "tok-123"
    assert opts.order_by == ("a", "b") and "tok-123" not in repr(opts)
    assert SinkOptions.from_spark(opts.to_spark()) == opts


def test_missing_producer_id_says_how_to_name_the_run():
    with pytest.raises(ConfigError, match="producerId is required.*name the run"):
        SinkOptions.from_spark({"stream": "S", "keyColumn": "k"})


def test_unknown_options_are_named():
    with pytest.raises(ConfigError, match="unknown option.*keycolum\\b"):
        SinkOptions.from_spark({**BASE, "keyColum": "x"})


def test_pyspark_and_pyspark_client_are_the_same_release():
    """Both install the pyspark/ package folder; two releases over each other would mix
    files of both (the Spark provider pulls pyspark-client, the spark extra pyspark)."""
    import pyspark

    installed = {}
    for dist in ("pyspark", "pyspark-client"):
        try:
            installed[dist] = version(dist)
        except PackageNotFoundError:
            continue
    assert len(set(installed.values())) <= 1, installed
    assert pyspark.__version__ == installed.get("pyspark", pyspark.__version__)
