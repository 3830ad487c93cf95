"""ConnectionOptions and connect() against real nats-server processes (and pure validation).

Every auth method is exercised end to end: user/password, token, nkey, decentralized JWT
(.creds), and mutual TLS. Failures must be named errors that say what to fix and never
contain a secret.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import authfixtures as af
import nats
import pytest

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import AuthError, ConfigError, ConnectError
from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.embedded.servers import NatsServer

PASSWORD = "pw-Zq8s1Xx-secret"
TOKEN = "tok-9fj3kQ-secret"


async def _roundtrip(options: ConnectionOptions) -> None:
    """Connect, request/reply through the server, close."""
    nc = await connect(options)
    try:
        assert nc.is_connected

        async def echo(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("echo", cb=echo)
        reply = await nc.request("echo", b"ping", timeout=2)
        assert reply.data == b"ping"
    finally:
        await nc.close()


#: Bound on a connection attempt that must fail rather than hang: only a hang reaches it
#: (no test here measures speed; a loaded CI machine is slow, not stuck).
_HANG = 60.0


def _connect_error(options: ConnectionOptions) -> ConnectError:
    async def attempt() -> None:
        nc = await connect(options)
        await nc.close()

    with pytest.raises(ConnectError) as info:
        asyncio.run(attempt())
    return info.value


def _assert_secret_free(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text


# ---------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def userpass_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = f'authorization {{ user: alice, password: "{PASSWORD}" }}'
    with NatsServer(tmp_path_factory.mktemp("userpass"), extra_config=config) as server:
        yield server


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = f'authorization {{ token: "{TOKEN}" }}'
    with NatsServer(tmp_path_factory.mktemp("token"), extra_config=config) as server:
        yield server


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> af.Pki:
    return af.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: af.Pki) -> Iterator[NatsServer]:
    with NatsServer(
        tmp_path_factory.mktemp("tls"), extra_config=pki.server_tls_block(verify=True)
    ) as server:
        yield server


# ---------------------------------------------------------------------------- basic


def test_connect_plain_and_repr_names_server(nats_url: str) -> None:
    options = ConnectionOptions(servers=(nats_url,), name="t-plain")
    asyncio.run(_roundtrip(options))
    assert nats_url in options.describe()
    assert options.auth_method == "none"
    assert options.ssl_context() is None


def test_reconnects_after_server_restart(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="airflow_nats_ordered")

    async def scenario() -> None:
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        options = ConnectionOptions(servers=(nats_server.url,), reconnect_time_wait=0.1)
        nc = await connect(options, reconnected_cb=on_reconnect)
        try:
            await nc.flush(timeout=2)
            nats_server.kill()
            nats_server.restart()
            await asyncio.wait_for(reconnected.wait(), timeout=10)
            await nc.flush(timeout=2)
            assert nc.is_connected and nc.stats["reconnects"] >= 1
        finally:
            await nc.close()

    asyncio.run(scenario())
    assert "reconnecting" in caplog.text and "reconnected to" in caplog.text


def test_outage_logs_once_and_never_the_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = f'authorization {{ user: alice, password: "{PASSWORD}" }}'
    server = NatsServer(tmp_path / "srv", extra_config=config)

    async def scenario() -> None:
        options = ConnectionOptions(
            servers=(server.url,), user="alice", password=PASSWORD, reconnect_time_wait=0.05
        )
        nc = await connect(options)
        try:
            server.stop()
            await asyncio.sleep(0.6)  # several failed reconnect attempts
            server.start()
            deadline = time.monotonic() + 10
            while not nc.is_connected:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await nc.flush(timeout=2)
        finally:
            await nc.close()

    with server:
        asyncio.run(scenario())
    errors = [
        r
        for r in caplog.records
        if r.name.startswith("airflow_nats_ordered") and "connection error" in r.getMessage()
    ]
    assert len(errors) > 1
    assert sum(r.levelno == logging.WARNING for r in errors) == 1
    _assert_secret_free(caplog.text, PASSWORD)


def test_user_callbacks_run_and_reconnect_disabled_closes(nats_server: NatsServer) -> None:
    events: list[str] = []

    async def disconnected() -> None:
        events.append("disconnected")

    async def closed() -> None:
        events.append("closed")

    async def scenario() -> None:
        nc = await connect(
            ConnectionOptions(servers=(nats_server.url,), max_reconnect_attempts=0),
            disconnected_cb=disconnected,
            closed_cb=closed,
        )
        nats_server.stop()
        deadline = time.monotonic() + 5
        while not nc.is_closed:
            assert time.monotonic() < deadline, "client kept reconnecting with attempts=0"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert "closed" in events


def test_extra_kwargs_cannot_override_owned_options(nats_url: str) -> None:
    with pytest.raises(TypeError, match="ConnectionOptions.servers"):
        asyncio.run(connect(ConnectionOptions(servers=(nats_url,)), servers=["nats://x:1"]))


# ---------------------------------------------------------------------------- user/password


def test_user_password_ok(userpass_server: NatsServer) -> None:
    asyncio.run(
        _roundtrip(
            ConnectionOptions(servers=(userpass_server.url,), user="alice", password=PASSWORD)
        )
    )


def test_wrong_password_is_auth_error_without_password(
    userpass_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "not-the-pw-3k2j"
    caplog.set_level(logging.DEBUG)
    options = ConnectionOptions(servers=(userpass_server.url,), user="alice", password=wrong)
    err = _connect_error(options)
    assert isinstance(err, AuthError)
    message = str(err)
    assert "user/password" in message and "'alice'" in message
    assert userpass_server.url in message
    assert "NATS_PASSWORD" in message
    _assert_secret_free(message + repr(err.args) + caplog.text, wrong, PASSWORD)
    _assert_secret_free(repr(options) + str(options) + options.describe(), wrong)
    assert "password='***'" in repr(options)


def test_password_in_url_is_moved_out_and_hidden(userpass_server: NatsServer) -> None:
    url = userpass_server.url.replace("nats://", f"nats://alice:{PASSWORD}@")
    options = ConnectionOptions(servers=(url,))
    assert options.servers == (userpass_server.url,)
    assert options.user == "alice" and options.password == PASSWORD
    _assert_secret_free(repr(options) + options.describe(), PASSWORD)
    asyncio.run(_roundtrip(options))


def test_no_credentials_against_auth_server_says_what_to_set(userpass_server: NatsServer) -> None:
    err = _connect_error(ConnectionOptions(servers=(userpass_server.url,)))
    assert isinstance(err, AuthError)
    assert "no credentials" in str(err) and "NATS_USER" in str(err)


# ---------------------------------------------------------------------------- token


def test_token_ok_and_wrong(token_server: NatsServer) -> None:
    asyncio.run(_roundtrip(ConnectionOptions(servers=(token_server.url,), token=TOKEN)))
    wrong = "wrong-token-77a"
    err = _connect_error(ConnectionOptions(servers=(token_server.url,), token=wrong))
    assert isinstance(err, AuthError)
    assert "auth method used: token" in str(err) and "NATS_TOKEN" in str(err)
    _assert_secret_free(str(err), wrong, TOKEN)


def test_token_in_url(token_server: NatsServer) -> None:
    options = ConnectionOptions(servers=(token_server.url.replace("nats://", f"nats://{TOKEN}@"),))
    assert options.token == TOKEN and TOKEN not in repr(options)
    asyncio.run(_roundtrip(options))


# ---------------------------------------------------------------------------- nkey


def test_nkey_seed_file_and_inline_seed(tmp_path: Path) -> None:
    user = af.new_nkey("user")
    stranger = af.new_nkey("user")
    seed_file = tmp_path / "user.nk"
    seed_file.write_text(user.seed + "\n")
    stranger_file = tmp_path / "stranger.nk"
    stranger_file.write_text(stranger.seed)
    config = f"authorization {{ users: [ {{ nkey: {user.public} }} ] }}"
    with NatsServer(tmp_path / "srv", extra_config=config) as server:
        asyncio.run(
            _roundtrip(ConnectionOptions(servers=(server.url,), nkey_seed_file=str(seed_file)))
        )
        inline = ConnectionOptions(servers=(server.url,), nkey_seed=user.seed)
        _assert_secret_free(repr(inline) + inline.describe(), user.seed)
        asyncio.run(_roundtrip(inline))

        err = _connect_error(ConnectionOptions(servers=(server.url,), nkey_seed=stranger.seed))
        assert isinstance(err, AuthError)
        assert "nkey" in str(err) and "NATS_NKEY" in str(err)
        _assert_secret_free(str(err), stranger.seed, user.seed)
        err = _connect_error(
            ConnectionOptions(servers=(server.url,), nkey_seed_file=str(stranger_file))
        )
        assert isinstance(err, AuthError) and str(stranger_file) in str(err)


def test_invalid_seed_is_config_error_without_seed(tmp_path: Path) -> None:
    bogus = "SUNOTAREALSEED0000000000000000000000000000000000000000000"
    with pytest.raises(ConfigError, match="nkey_seed is not a valid") as info:
        ConnectionOptions(nkey_seed=bogus)
    assert bogus not in str(info.value)
    path = tmp_path / "bad.nk"
    path.write_text("hello")
    with pytest.raises(ConfigError, match="nkey_seed_file"):
        ConnectionOptions(nkey_seed_file=str(path))


# ---------------------------------------------------------------------------- creds (JWT)


def test_creds_file_decentralized_auth(tmp_path: Path) -> None:
    setup = af.make_decentralized(tmp_path / "jwt")
    other = af.make_decentralized(tmp_path / "other")  # signed by an unknown operator
    with NatsServer(tmp_path / "srv", extra_config=setup.server_config) as server:
        options = ConnectionOptions(servers=(server.url,), creds_file=str(setup.creds_path))
        assert options.auth_method == "creds"
        asyncio.run(_roundtrip(options))

        err = _connect_error(
            ConnectionOptions(servers=(server.url,), creds_file=str(other.creds_path))
        )
        assert isinstance(err, AuthError)
        assert str(other.creds_path) in str(err) and "NATS_CREDS" in str(err)
        _assert_secret_free(str(err), other.user.seed, setup.user.seed)


def test_malformed_creds_file_is_config_error(tmp_path: Path) -> None:
    # nats-py would loop forever reading this file; we refuse it up front
    path = tmp_path / "broken.creds"
    path.write_text("not a creds file\n")
    with pytest.raises(ConfigError, match="not a NATS credentials file"):
        ConnectionOptions(creds_file=str(path))


# ---------------------------------------------------------------------------- TLS


def test_mutual_tls_ok(tls_server: NatsServer, pki: af.Pki) -> None:
    options = ConnectionOptions(
        servers=(tls_server.url,),
        tls_ca_file=str(pki.ca_cert),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    assert options.tls_required and options.ssl_context() is not None
    asyncio.run(_roundtrip(options))
    # tls:// scheme and a hostname from the certificate work too
    asyncio.run(
        _roundtrip(
            ConnectionOptions(
                servers=(tls_server.url.replace("nats://", "tls://"),),
                tls_ca_file=str(pki.ca_cert),
                tls_cert_file=str(pki.client_cert),
                tls_key_file=str(pki.client_key),
                tls_hostname="localhost",
            )
        )
    )


def test_tls_without_client_cert_is_refused_clearly(tls_server: NatsServer, pki: af.Pki) -> None:
    started = time.monotonic()
    err = _connect_error(ConnectionOptions(servers=(tls_server.url,), tls_ca_file=str(pki.ca_cert)))
    assert time.monotonic() - started < _HANG  # refused, not left waiting
    assert isinstance(err, AuthError)
    message = str(err)
    assert "TLS handshake" in message and "client certificate" in message
    assert "tls_cert_file" in message and "NATS_CERT" in message


def test_tls_client_cert_from_unknown_ca_is_auth_error(
    tls_server: NatsServer, pki: af.Pki, tmp_path: Path
) -> None:
    foreign = af.make_pki(tmp_path / "foreign")
    err = _connect_error(
        ConnectionOptions(
            servers=(tls_server.url,),
            tls_ca_file=str(pki.ca_cert),
            tls_cert_file=str(foreign.client_cert),
            tls_key_file=str(foreign.client_key),
        )
    )
    assert isinstance(err, AuthError)
    assert str(foreign.client_cert) in str(err) and "NATS_CERT" in str(err)


def test_tls_untrusted_server_cert_names_ca_option(tls_server: NatsServer, pki: af.Pki) -> None:
    started = time.monotonic()
    err = _connect_error(
        ConnectionOptions(
            servers=(tls_server.url,),
            tls_cert_file=str(pki.client_cert),
            tls_key_file=str(pki.client_key),
        )
    )
    assert time.monotonic() - started < _HANG  # nats-py alone hangs here (for ever)
    assert not isinstance(err, AuthError)
    assert "TLS handshake" in str(err) and "tls_ca_file" in str(err) and "NATS_CA" in str(err)


def test_tls_requested_but_server_plain_is_refused(nats_url: str, pki: af.Pki) -> None:
    err = _connect_error(
        ConnectionOptions(
            servers=(nats_url.replace("nats://", "tls://"),), tls_ca_file=str(pki.ca_cert)
        )
    )
    assert "does not offer TLS" in str(err)


def test_bad_tls_files_are_config_errors(pki: af.Pki, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("junk")
    with pytest.raises(ConfigError, match="tls_ca_file"):
        ConnectionOptions(tls_ca_file=str(junk)).ssl_context()
    with pytest.raises(ConfigError, match="tls_cert_file"):
        ConnectionOptions(tls_cert_file=str(junk), tls_key_file=str(pki.client_key)).ssl_context()


# ---------------------------------------------------------------------------- unreachable


def test_unreachable_server_fails_fast_naming_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    err = _connect_error(ConnectionOptions(servers=(url,), connect_timeout=1.0))
    assert time.monotonic() - started < _HANG  # no endless reconnect loop
    assert not isinstance(err, AuthError)
    message = str(err)
    assert message.startswith(f"could not connect to {url} within 1.0s: ")
    assert "NATS_URL" in message and "--server" in message


def test_silent_server_times_out_at_connect_timeout() -> None:
    # A listener on loopback that completes TCP but never speaks (never sends INFO): what a
    # hung server or a black-holing proxy looks like. Only loopback: tests send nothing off
    # this machine.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        err = _connect_error(ConnectionOptions(servers=(url,), connect_timeout=0.5))
        assert time.monotonic() - started < _HANG
    assert url in str(err) and "0.5s" in str(err)


def test_several_unreachable_servers_are_all_named() -> None:
    urls = (f"nats://127.0.0.1:{free_port()}", f"nats://127.0.0.1:{free_port()}")
    err = _connect_error(ConnectionOptions(servers=urls, connect_timeout=1.0))
    assert all(u in str(err) for u in urls)


def test_one_dead_server_in_list_is_skipped(nats_url: str) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    asyncio.run(_roundtrip(ConnectionOptions(servers=(dead, nats_url))))


# ---------------------------------------------------------------------------- validation


def test_defaults_and_normalization() -> None:
    options = ConnectionOptions()
    assert options.servers == ("nats://127.0.0.1:4222",)
    assert options.connect_timeout == 5.0 and options.max_reconnect_attempts == 120
    assert ConnectionOptions(servers=("example.com:4333", "h2")).servers == (
        "nats://example.com:4333",
        "nats://h2:4222",
    )
    assert ConnectionOptions(servers=("[::1]:5000",)).servers == ("nats://[::1]:5000",)
    assert ConnectionOptions(servers=("tls://x",)).tls_required


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"servers": ()}, "servers is empty"),
        ({"servers": ("http://x:1",)}, "unsupported scheme 'http'"),
        ({"servers": ("nats://x:99999",)}, r"servers\[0\].*not a valid URL"),
        ({"servers": ("nats://:4222",)}, "has no host"),
        ({"servers": ("nats://a:1", "ws://b:2")}, "mix websocket"),
        ({"user": "bob"}, "user is set but password is not"),
        ({"password": "x"}, "password is set but user is not"),
        ({"user": "u", "password": "p", "token": "t"}, "more than one auth method"),
        ({"connect_timeout": 0}, "connect_timeout must be > 0"),
        ({"connect_timeout": "abc"}, "connect_timeout must be a number"),
        ({"max_reconnect_attempts": -5}, "max_reconnect_attempts must be -1"),
        ({"tls_verify": "yes"}, "tls_verify must be true or false"),
        ({"creds_file": "/no/such/file.creds"}, "creds_file file '/no/such/file.creds' does not"),
        ({"tls_ca_file": "/no/ca.pem"}, "tls_ca_file file '/no/ca.pem' does not exist"),
    ],
)
def test_invalid_options(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        ConnectionOptions(**kwargs)  # type: ignore[arg-type]


def test_cert_without_key_and_key_without_cert(pki: af.Pki) -> None:
    with pytest.raises(ConfigError, match="tls_key_file is not"):
        ConnectionOptions(tls_cert_file=str(pki.client_cert))
    with pytest.raises(ConfigError, match="tls_cert_file is not"):
        ConnectionOptions(tls_key_file=str(pki.client_key))


def test_secret_in_bad_url_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectionOptions(servers=(f"http://bob:{PASSWORD}@host:1",))
    assert PASSWORD not in str(info.value) and "***@host:1" in str(info.value)


def test_from_mapping() -> None:
    options = ConnectionOptions.from_mapping(
        {
            "servers": "nats://a:1, nats://b:2",
            "connect_timeout": "2.5",
            "max_reconnect_attempts": "7",
            "tls_verify": "false",
            "token": TOKEN,
            "user": None,
        }
    )
    assert options.servers == ("nats://a:1", "nats://b:2")
    assert options.connect_timeout == 2.5 and options.max_reconnect_attempts == 7
    assert options.tls_verify is False and options.token == TOKEN
    assert ConnectionOptions.from_mapping({"servers": ["x:1"]}).servers == ("nats://x:1",)


def test_from_mapping_errors() -> None:
    with pytest.raises(ConfigError, match="unknown connection option") as info:
        ConnectionOptions.from_mapping({"server": "x", "pasword": "y"})
    message = str(info.value)
    assert "pasword, server" in message and "servers" in message and "connect_timeout" in message
    with pytest.raises(ConfigError, match="connect_timeout must be a number.*'abc'"):
        ConnectionOptions.from_mapping({"connect_timeout": "abc"})
    with pytest.raises(ConfigError, match="max_reconnect_attempts must be an integer"):
        ConnectionOptions.from_mapping({"max_reconnect_attempts": "1.5x"})
    with pytest.raises(ConfigError, match="servers must be a list"):
        ConnectionOptions.from_mapping({"servers": 12})
    with pytest.raises(ConfigError, match="password must be a string, got int") as info:
        ConnectionOptions.from_mapping({"user": "u", "password": 123456789})
    assert "123456789" not in str(info.value)


def test_from_env(tmp_path: Path) -> None:
    creds = af.make_decentralized(tmp_path).creds_path
    env = {
        "NATS_URL": "nats://a:1,b:2",
        "NATS_CREDS": str(creds),
        "NATS_TOKEN": "",  # empty means unset
    }
    options = ConnectionOptions.from_env(env)
    assert options.servers == ("nats://a:1", "nats://b:2")
    assert options.creds_file == str(creds)
    assert ConnectionOptions.from_env({}).servers == ("nats://127.0.0.1:4222",)
    # overrides win; None overrides (unset CLI flags) are ignored
    overridden = ConnectionOptions.from_env(env, servers="c:3", connect_timeout=None)
    assert overridden.servers == ("nats://c:3",) and overridden.creds_file == str(creds)
    # an auth override replaces the environment's auth method instead of clashing
    switched = ConnectionOptions.from_env(env, user="u", password="p")
    assert switched.creds_file is None and switched.auth_method == "user/password"
    # overriding one member of a pair keeps the other from the environment
    mixed = ConnectionOptions.from_env({"NATS_USER": "u", "NATS_PASSWORD": "p"}, user="v")
    assert (mixed.user, mixed.password) == ("v", "p")


def test_url_credentials_are_percent_decoded() -> None:
    options = ConnectionOptions(servers=("nats://bob:p%40ss%3Aword@h:1",))
    assert (options.user, options.password, options.servers) == (
        "bob",
        "p@ss:word",
        ("nats://h:1",),
    )


def test_from_env_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="NATS_CREDS") as info:
        ConnectionOptions.from_env({"NATS_CREDS": "/missing.creds"})
    assert "creds_file" in str(info.value)
    with pytest.raises(ConfigError, match="NATS_URL"):
        ConnectionOptions.from_env({"NATS_URL": "http://x"})
    with pytest.raises(ConfigError, match="NATS_PASSWORD"):
        ConnectionOptions.from_env({"NATS_USER": "bob"})
    with pytest.raises(ConfigError, match="more than one auth method"):
        ConnectionOptions.from_env({"NATS_USER": "u", "NATS_PASSWORD": "p", "NATS_TOKEN": "t"})


def test_frozen_and_hashable() -> None:
    options = ConnectionOptions(token=TOKEN)
    with pytest.raises(AttributeError):
        options.token = "x"  # type: ignore[misc]
    assert hash(options) == hash(ConnectionOptions(token=TOKEN))
    assert options.redact(f"oops {TOKEN}") == "oops ***"
