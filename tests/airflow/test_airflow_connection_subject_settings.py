"""The ``nats`` connection's ``inbox_prefix``, ``js_domain`` and ``js_api_prefix`` extras
(issue 31 item 4): a bad value is an error naming the connection and the field; a user
whose permissions deny ``_INBOX.>`` passes the connection test (the UI's Test button) only
with the inbox prefix its permissions allow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.hooks.nats import NatsHook, options_from_connection


def _options(**extra: object):
    return options_from_connection(
        "nats_locked", host="nats-1:4222", port=None, login=None, password=None, extra=extra
    )


def test_the_extras_become_the_connection_settings() -> None:
    opts = _options(inbox_prefix="_ORDERS", js_domain="leaf", js_api_prefix="")
    assert (opts.inbox_prefix, opts.api_prefix) == ("_ORDERS", "$JS.leaf.API")
    # as the UI stores form fields
    opts = _options(extra__nats__js_api_prefix="JS.hub.API")
    assert opts.api_prefix == "JS.hub.API"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"inbox_prefix": "_MY INBOX"},
            "Airflow connection 'nats_locked', Inbox prefix (extra 'inbox_prefix'): "
            "inbox_prefix '_MY INBOX' is not a subject prefix",
        ),
        (
            {"js_domain": "leaf.one"},
            "Airflow connection 'nats_locked', JetStream domain (extra 'js_domain'): "
            "js_domain 'leaf.one' is not a JetStream domain name",
        ),
        (
            {"js_domain": "leaf", "js_api_prefix": "JS.x.API"},
            "Airflow connection 'nats_locked', JetStream API prefix (extra 'js_api_prefix'): "
            "both js_domain and js_api_prefix are set",
        ),
    ],
)
def test_a_bad_value_names_the_connection_and_the_field(extra, expected) -> None:
    with pytest.raises(ConfigError) as err:
        _options(**extra)
    assert expected in str(err.value)
    assert "NATS_" not in str(err.value)  # the CLI's variables mean nothing here


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = """
authorization {
  users = [
    { user: locked, password: "pw-locked-af",
      permissions: { publish: { allow: [">"] },
                     subscribe: { allow: [">"], deny: ["_INBOX.>"] } } }
  ]
}
"""
    with NatsServer(Path(tmp_path_factory.mktemp("locked-af")), extra_config=config) as server:
        yield server


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"inbox_prefix": "_AFINBOX"}, None),
        ({}, "set the connection's Inbox prefix field (extra inbox_prefix)"),
        (
            {"inbox_prefix": "_AFINBOX", "js_domain": "nowhere"},
            "JetStream is not available to this account in JetStream domain 'nowhere' "
            "(extra 'js_domain')",
        ),
    ],
)
def test_the_connection_test_needs_the_allowed_inbox_prefix_and_names_the_domain(
    locked_server: NatsServer,
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, object],
    expected: str | None,
) -> None:
    conn = {
        "conn_type": "nats",
        "host": f"127.0.0.1:{locked_server.port}",
        "login": "locked",
        "password": "pw-locked-af",
        "extra": {"connect_timeout": 1, **extra},
    }
    monkeypatch.setenv("AIRFLOW_CONN_NATS_LOCKED", json.dumps(conn))
    ok, message = NatsHook("nats_locked").test_connection()
    if expected is None:
        assert ok, message
        assert "JetStream is enabled" in message
    else:
        assert not ok and expected in message, message
        assert "pw-locked-af" not in message
