"""The ``nats`` connection type and NatsHook, against real servers and Airflow's own
connection lookup (``AIRFLOW_CONN_<ID>`` environment variables, JSON form)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import authfixtures as af
import pytest

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.hooks.nats import NatsHook, options_from_connection

PASSWORD = "s3cret-pass-word"


@pytest.fixture
def airflow_conn(monkeypatch: pytest.MonkeyPatch):
    """Define an Airflow connection through the environment, as a deployment would."""

    def define(conn_id: str, **fields) -> str:
        monkeypatch.setenv(
            f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "nats", **fields})
        )
        return conn_id

    return define


@pytest.fixture(scope="module")
def userpass_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = f'authorization {{ user: alice, password: "{PASSWORD}" }}'
    with NatsServer(tmp_path_factory.mktemp("userpass"), extra_config=config) as server:
        yield server


def _opts(**kw):
    base = {"host": None, "port": None, "login": None, "password": None, "extra": {}}
    return options_from_connection("nats_test", **{**base, **kw})


def test_host_port_login_and_password_map_onto_connection_options() -> None:
    o = _opts(
        host="a.example, b.example:4333,tls://c.example:4443",
        port=4224,
        login="bob",
        password=PASSWORD,
    )
    assert o.servers == ("nats://a.example:4224", "nats://b.example:4333", "tls://c.example:4443")
    assert (o.user, o.password) == ("bob", PASSWORD)
    assert PASSWORD not in repr(o)


def test_servers_extra_replaces_host_and_both_at_once_is_refused() -> None:
    o = _opts(extra={"servers": "nats://x:1,nats://y:2", "connect_timeout": "2.5"})
    assert o.servers == ("nats://x:1", "nats://y:2") and o.connect_timeout == 2.5
    with pytest.raises(ConfigError, match="both Host and extra 'servers'"):
        _opts(host="a", extra={"servers": "nats://x:1"})


def test_credentials_given_as_content_go_to_private_files(tmp_path: Path) -> None:
    setup = af.make_decentralized(tmp_path)
    text = setup.creds_path.read_text()
    o = _opts(host="127.0.0.1", extra={"creds_secret": text})
    assert o.creds_file and o.creds_file != str(setup.creds_path)
    assert Path(o.creds_file).read_text().strip() == text.strip()
    assert stat.S_IMODE(os.stat(o.creds_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(o.creds_file).parent).st_mode) == 0o700
    assert setup.user.seed not in repr(o)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"extra": {"tokn": "x"}}, ["nats_test", "unknown extra field(s) tokn", "token"]),
        ({"login": "bob"}, ["nats_test", "Password", "password is not"]),
        (
            {"extra": {"creds_secret": "x", "creds_file": "/etc/hosts"}},
            ["'creds_secret'", "'creds_file'"],
        ),
        ({"extra": {"nkey_seed": "SU" + "A" * 56}}, ["rename extra 'nkey_seed' to"]),
        (
            {"extra": {"tls_cert_file": "/nonexistent.pem"}},
            ["extra 'tls_cert_file'", "does not exist"],
        ),
        ({"extra": {"connect_timeout": "soon"}}, ["connect_timeout"]),
    ],
)
def test_malformed_connections_name_the_connection_field_to_fix(fields, names) -> None:
    with pytest.raises(ConfigError) as err:
        _opts(**fields)
    for name in names:
        assert name in str(err.value)
    assert "NATS_" not in str(err.value)  # env var hints are for CLI users, not here


def test_test_connection_reports_reachable_server_with_jetstream(nats_url, airflow_conn) -> None:
    host = nats_url.removeprefix("nats://")
    ok, message = NatsHook(airflow_conn("nats_hook_ok", host=host)).test_connection()
    assert ok, message
    assert "JetStream is enabled" in message


def test_test_connection_says_credentials_were_rejected(userpass_server, airflow_conn) -> None:
    conn = airflow_conn(
        "nats_hook_badpw",
        host=userpass_server.url.removeprefix("nats://"),
        login="alice",
        password="wrong-password-123",
    )
    ok, message = NatsHook(conn).test_connection()
    assert not ok
    assert "rejected" in message.lower() or "authorization" in message.lower(), message
    assert "wrong-password-123" not in message
    good = airflow_conn(
        "nats_hook_goodpw",
        host=userpass_server.url.removeprefix("nats://"),
        login="alice",
        password=PASSWORD,
    )
    assert NatsHook(good).test_connection()[0]


def test_test_connection_says_server_unreachable(airflow_conn) -> None:
    from airflow_nats_ordered.embedded.process import free_port

    conn = airflow_conn(
        "nats_hook_down", host=f"127.0.0.1:{free_port()}", extra={"connect_timeout": 1}
    )
    ok, message = NatsHook(conn).test_connection()
    assert not ok and "127.0.0.1" in message, message
    assert "Host/Port of this connection" in message and "NATS_URL" not in message


def test_test_connection_says_jetstream_is_not_enabled(tmp_path, airflow_conn) -> None:
    with NatsServer(tmp_path / "nojs", jetstream=False) as server:
        conn = airflow_conn("nats_hook_nojs", host=server.url.removeprefix("nats://"))
        ok, message = NatsHook(conn).test_connection()
    assert not ok and "JetStream is not available" in message, message


def test_hook_run_gives_operators_a_connected_client(nats_url, airflow_conn) -> None:
    hook = NatsHook(airflow_conn("nats_hook_run", extra={"servers": nats_url}))

    async def rtt(nc) -> bool:
        await nc.flush()
        return nc.is_connected

    assert hook.run(rtt) is True
    assert hook.run(rtt) is True  # a fresh loop each call; the options stay cached


def test_provider_registers_the_nats_connection_form_with_masked_secrets() -> None:
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    hooks = ProvidersManagerTaskRuntime().hooks
    assert hooks["nats"].hook_class_name == "airflow_nats_ordered.hooks.nats.NatsHook"
    pm = ProvidersManager()
    widgets = pm.connection_form_widgets
    for secret in ("token", "creds_secret", "nkey_seed_secret", "tls_private_key"):
        assert widgets[f"extra__nats__{secret}"].is_sensitive, secret
    for plain in ("servers", "creds_file", "tls_ca"):
        assert not widgets[f"extra__nats__{plain}"].is_sensitive, plain
    assert "schema" in pm.field_behaviours["nats"]["hidden_fields"]
