"""One source of NATS connection settings for a Spark write (issue 16 item 2, issue 17 item 8):
every setting reaches the driver, the driver reads them once, and its tasks and its ledger
reads use exactly that copy, whatever the environment says later."""

from __future__ import annotations

import json
import os

import pytest
from authfixtures import new_nkey
from spark_helpers import make_stream, run_record, stored
from streamcheck import read_stream

from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.embedded.servers import NatsServer

pytest.importorskip("pyspark")

from airflow_nats_ordered.operators.spark import nats_env  # noqa: E402
from airflow_nats_ordered.spark import SinkOptions, write_ordered  # noqa: E402
from airflow_nats_ordered.spark.datasource import _on_nats  # noqa: E402

BASE = {"stream": "FLIGHTS", "keyColumn": "tailnum", "producerId": "run-1"}
BOGUS = "nats://127.0.0.1:1"  # nothing listens on port 1
TOKEN = "tok-settings-5d2e8a91"


def _no_nats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)


def _files(tmp_path) -> dict[str, str]:
    out = {}
    for name in ("ca", "cert", "key"):
        path = tmp_path / f"{name}.pem"
        path.write_text("PEM\n")  # only checked to exist until a TLS context is made
        out[name] = str(path)
    return out


@pytest.mark.parametrize("auth", ["user", "nkey_seed"])
def test_every_connection_setting_reaches_the_driver(monkeypatch, tmp_path, auth):
    """The operator's environment gives the driver's sink the connection field for field:
    the old one dropped tls_hostname, tls_verify, connect_timeout, name and the reconnect
    settings, and refused an inline nkey seed."""
    f = _files(tmp_path)
    creds = (
        {"user": "bob", "password": "pw-never-shown"}
        if auth == "user"
        else {"nkey_seed": new_nkey().seed}
    )
    want = ConnectionOptions(
        servers=("tls://127.0.0.1:4443", "tls://127.0.0.1:4444"),
        tls_ca_file=f["ca"],
        tls_cert_file=f["cert"],
        tls_key_file=f["key"],
        tls_hostname="nats.internal",
        tls_verify=False,
        name="flights-job",
        connect_timeout=2.5,
        reconnect_time_wait=1.5,
        max_reconnect_attempts=7,
        ping_interval=9.0,
        max_outstanding_pings=4,
        **creds,
    )
    _no_nats_env(monkeypatch)
    for var, value in nats_env(want).items():
        monkeypatch.setenv(var, value)
    got = SinkOptions.from_spark(BASE).connection_options()
    assert got == want, f"the driver got {got}"


def test_a_nats_variable_of_the_airflow_worker_does_not_mix_in(monkeypatch, tmp_path):
    """spark-submit runs with the Airflow worker's environment plus the operator's env_vars:
    a NATS_CREDS of the worker's own must not reach the driver beside the connection's token
    (the old operator left it: 'more than one auth method')."""
    creds = tmp_path / "other.creds"
    creds.write_text("not used\n")
    _no_nats_env(monkeypatch)
    monkeypatch.setenv("NATS_CREDS", str(creds))  # the worker's own, another auth method
    env = nats_env(ConnectionOptions(servers=("nats://127.0.0.1:4222",), token="tok-1"))
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert SinkOptions.from_spark(BASE).connection_options().auth_method == "token"


def test_a_bad_variable_is_named_without_its_value(monkeypatch):
    _no_nats_env(monkeypatch)
    monkeypatch.setenv("NATS_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="NATS_CONNECT_TIMEOUT"):
        SinkOptions.from_spark(BASE)
    monkeypatch.setenv("NATS_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("NATS_NKEY_SEED", "SUnot-a-seed-secret-77")
    with pytest.raises(ConfigError, match="NATS_NKEY_SEED") as err:
        SinkOptions.from_spark(BASE)
    assert "not-a-seed-secret-77" not in str(err.value)


def test_a_file_missing_on_the_task_host_is_named_with_its_variable(monkeypatch, tmp_path):
    creds = tmp_path / "ca.pem"
    creds.write_text("PEM\n")
    _no_nats_env(monkeypatch)
    monkeypatch.setenv("NATS_CA", str(creds))
    opts = SinkOptions.from_spark(BASE)
    creds.unlink()  # as on an executor host without the file
    with pytest.raises(ConfigError, match="NATS_CA.*same path on every executor host"):
        opts.connection_options()


def test_the_driver_reads_the_environment_once(monkeypatch, nats_url, unique_name):
    """Settings read when the write's options were made are the ones every connection of
    the write uses (the old code re-read NATS_URL at each connection: the bogus one)."""
    make_stream(nats_url, unique_name, partitions=1)
    _no_nats_env(monkeypatch)
    monkeypatch.setenv("NATS_URL", nats_url)
    opts = SinkOptions.from_spark({**BASE, "stream": unique_name})
    monkeypatch.setenv("NATS_URL", BOGUS)

    async def where(nc) -> str:
        return f"nats://{nc.connected_url.netloc}"

    assert _on_nats(opts, where) == nats_url
    assert "url" in opts.pinned_connection() and opts.pinned_connection()["auth"] == "none"


def test_write_ordered_writes_where_it_read_the_ledger(spark, monkeypatch, nats_url, unique_name):
    """NATS_URL set after the SparkSession started: write_ordered read the ledger (and the
    partition count) from it, but the data source, run by Spark's JVM with the environment
    it started with, connected elsewhere (the old code: 127.0.0.1:4222 or nothing)."""
    make_stream(nats_url, unique_name, partitions=2)
    _no_nats_env(monkeypatch)
    monkeypatch.setenv("NATS_URL", nats_url)  # after the session's JVM started
    rows = [{"k": f"k{i % 3}", "n": i} for i in range(6)]
    df = spark.createDataFrame(rows, "k string, n long")
    rec = write_ordered(df, stream=unique_name, key="k", order_by="n", producer_id="once.1")
    assert rec.status == "complete" and rec.acked == 6
    got = stored(nats_url, unique_name)
    assert sorted(json.loads(s.data)["n"] for s in got) == list(range(6))
    assert run_record(nats_url, unique_name, "once.1") is not None


def test_a_token_the_spark_jvm_never_saw_is_refused_naming_why(
    spark, monkeypatch, tmp_path, unique_name
):
    """NATS_URL and NATS_TOKEN set after the SparkSession started: write_ordered reads the
    ledger with the token, the data source (Spark's JVM environment) has none. Refused on the
    driver before any task runs, saying which environment is read (the old code: the
    server's 'authorization violation', auth method none, while NATS_TOKEN was set)."""
    config = f'authorization {{ token: "{TOKEN}" }}'
    with NatsServer(tmp_path / "nats", extra_config=config) as server:
        _no_nats_env(monkeypatch)
        monkeypatch.setenv("NATS_URL", server.url)
        monkeypatch.setenv("NATS_TOKEN", TOKEN)
        opts = SinkOptions.from_spark({**BASE, "stream": unique_name})
        _on_nats(opts, lambda nc: provision(nc, StreamSpec(unique_name, partitions=1)))
        df = spark.createDataFrame([("a", 1)], "k string, n long")
        with pytest.raises(Exception, match="set them before the SparkSession starts") as err:
            write_ordered(df, stream=unique_name, key="k", order_by="n", producer_id="auth.1")
        assert TOKEN not in str(err.value)
        assert _on_nats(opts, lambda nc: read_stream(nc, unique_name)) == []
