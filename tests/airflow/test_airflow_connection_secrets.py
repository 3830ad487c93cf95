"""Every secret a ``nats`` connection holds stays hidden wherever Airflow shows it (issue 16
item 1): the REST API's ``ConnectionResponse`` (which the UI reads), the UI's edit round
trip, and logs (the secrets masker). Airflow hides extras by key NAME, so the test takes the
secret fields from the provider's own connection form, fills them with real credentials,
and looks for any piece of them in what Airflow shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import authfixtures as af
import pytest

from airflow_nats_ordered import get_provider_info
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.hooks.connection_secrets import RENAMED_SECRET_EXTRAS
from airflow_nats_ordered.hooks.nats import NatsHook, options_from_connection


def _form_fields() -> dict:
    (conn_type,) = get_provider_info()["connection-types"]
    return conn_type["conn-fields"]


def _secret_form_fields() -> list[str]:
    return [k for k, f in _form_fields().items() if f["schema"].get("format") == "password"]


def _pieces(value: str) -> list[str]:
    """The value and each of its key-material lines (a JWT, a seed, a PEM line)."""
    lines = [ln.strip() for ln in value.splitlines()]
    key_lines = [ln for ln in lines if re.fullmatch(r"[^-*\s]\S{15,}", ln)]  # no prose
    return [value, *key_lines]


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Real credentials: a .creds file's content, an nkey seed, a TLS client key (PEM)."""
    base = tmp_path_factory.mktemp("conn-secrets")
    return {
        "creds": af.make_decentralized(base / "jwt").creds_path.read_text(),
        "nkey": af.new_nkey("user").seed,
        "tls_key": af.make_pki(base / "pki").client_key.read_text(),
        "token": "tok-" + "7f3a9c2e" * 4,
    }


def _fill(fields: list[str], secrets: dict[str, str]) -> dict[str, str]:
    """A value for each secret form field, by what the field holds."""
    out = {}
    for name in fields:
        if "creds" in name:
            out[name] = secrets["creds"]
        elif "nkey" in name:
            out[name] = secrets["nkey"]
        elif "key" in name:
            out[name] = secrets["tls_key"]
        else:
            out[name] = secrets["token"]
    return out


def test_the_form_has_a_secret_field_for_every_kind_of_secret() -> None:
    fields = _secret_form_fields()
    assert any("token" in f for f in fields)
    assert any("creds" in f for f in fields)
    assert any("nkey" in f for f in fields)
    assert any(f.startswith("tls") and "key" in f for f in fields)


def test_rest_api_response_shows_no_secret_of_the_connection_form(secrets) -> None:
    from airflow.api_fastapi.core_api.datamodels.connections import ConnectionResponse
    from airflow.models.connection import Connection

    extra = _fill(_secret_form_fields(), secrets)
    conn = Connection(
        conn_id="nats_secrets",
        conn_type="nats",
        host="127.0.0.1:4222",
        login="alice",
        password="pw-" + "e4d1" * 5,
        extra=json.dumps({**extra, "tls_verify": True, "creds_file": "/etc/nats/u.creds"}),
    )
    # what GET /api/v2/connections/{id} returns (the route returns the ORM object)
    shown = ConnectionResponse.model_validate(conn).model_dump_json(by_alias=True)
    leaked = [
        name
        for name, value in (*extra.items(), ("password", conn.password))
        for piece in _pieces(value)
        if piece in shown
    ]
    assert not leaked, f"shown in clear by the REST API: {sorted(set(leaked))}"
    hidden = json.loads(json.loads(shown)["extra"])
    assert {k: hidden[k] for k in extra} == dict.fromkeys(extra, "***")
    assert hidden["creds_file"] == "/etc/nats/u.creds" and hidden["tls_verify"] is True


def test_ui_edit_round_trip_keeps_the_hidden_secrets(secrets) -> None:
    """The UI sends back '***' for a hidden value; Airflow's PATCH merges the stored one
    back in only for names its masker hides."""
    from airflow._shared.secrets_masker import merge, redact

    extra = {**_fill(_secret_form_fields(), secrets), "connect_timeout": 5}
    shown = redact(extra)
    assert [k for k in _secret_form_fields() if shown[k] != "***"] == []
    edited = {**shown, "connect_timeout": 7}
    assert merge(edited, extra) == {**extra, "connect_timeout": 7}
    # why the former names are refused: under them, a *** sent back (had the value been
    # masked) would replace the stored secret
    for old, new in RENAMED_SECRET_EXTRAS.items():
        assert merge({old: "***"}, {old: secrets["token"]}) == {old: "***"}
        assert merge({new: "***"}, {new: secrets["token"]}) == {new: secrets["token"]}


def test_secrets_read_by_the_hook_are_masked_in_logs(secrets, monkeypatch) -> None:
    from airflow.sdk._shared.secrets_masker import redact

    extra = _fill(_secret_form_fields(), secrets)
    token_field = next(f for f in _secret_form_fields() if "token" in f)
    del extra[token_field]  # the token name is hidden by Airflow already (see the API test)
    password = "pw-" + "a9b8" * 5
    monkeypatch.setenv(
        "AIRFLOW_CONN_NATS_LOGMASK",
        json.dumps({"conn_type": "nats", "login": "u1", "password": password, "extra": extra}),
    )
    # several auth methods at once: refused, but read first, and so masked
    with pytest.raises(ConfigError) as err:
        NatsHook("nats_logmask").get_options()
    assert not [p for v in (*extra.values(), password) for p in _pieces(v) if p in str(err.value)]
    pieces = [p for v in (*extra.values(), password) for p in _pieces(v)]
    line = "connecting with " + " | ".join(pieces)
    assert not [p for p in pieces if p in redact(line)], "a secret reached a log line"


@pytest.mark.parametrize(
    ("old", "new", "kind"),
    [
        ("creds", "creds_secret", "creds"),
        ("nkey_seed", "nkey_seed_secret", "nkey"),
        ("tls_key", "tls_private_key", "tls_key"),
    ],
)
def test_a_secret_under_a_former_name_is_refused_unread_with_the_rename(
    tmp_path, monkeypatch, old, new, kind
) -> None:
    """Issue 30 defect 1: the former names are shown in clear by Airflow and not kept by the
    UI's Save once masked; refused, the value is never registered with the masker (see
    test_airflow_connection_roundtrip.py for the round trip through a real api-server)."""
    from airflow.sdk._shared.secrets_masker import redact

    fresh = {  # never seen by this process's masker
        "creds": lambda: af.make_decentralized(tmp_path / "jwt").creds_path.read_text(),
        "nkey": lambda: af.new_nkey("user").seed,
        "tls_key": lambda: af.make_pki(tmp_path / "pki").client_key.read_text(),
    }
    value = fresh[kind]()
    conn_id = f"nats_former_{old}"
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}",
        json.dumps({"conn_type": "nats", "host": "127.0.0.1:4222", "extra": {old: value}}),
    )
    with pytest.raises(ConfigError) as err:
        NatsHook(conn_id).get_options()
    text = str(err.value)
    assert f"Airflow connection '{conn_id}': rename extra '{old}' to '{new}'" in text, text
    assert not [p for p in _pieces(value) if p in text]
    assert [p for p in _pieces(value) if redact(p) != p] == [], "registered with the masker"
    ok, message = NatsHook(conn_id).test_connection()  # the UI's Test button
    assert not ok and f"rename extra '{old}' to '{new}'" in message, message


def test_former_names_both_set_prefixed_or_left_blank() -> None:
    def opts(extra: dict) -> object:
        return options_from_connection(
            "c", host="127.0.0.1", port=None, login=None, password=None, extra=extra
        )

    with pytest.raises(ConfigError, match="remove extra 'creds' .*'creds_secret', also set"):
        opts({"creds": "x" * 20, "creds_secret": "y" * 20})
    with pytest.raises(
        ConfigError, match="rename extra 'extra__nats__tls_key' to 'extra__nats__tls_private_key'"
    ):
        opts({"extra__nats__tls_key": "z" * 20})
    with pytest.raises(ConfigError) as err:
        opts({"nkey_seed": "a" * 20, "tls_key": "b" * 20})
    assert "rename extra 'nkey_seed' to 'nkey_seed_secret'; rename extra 'tls_key'" in str(
        err.value
    )
    # an older form's blank fields hold nothing: nothing to rename
    blank = opts({"creds": "", "extra__nats__nkey_seed": "", "tls_key": None})
    assert blank.auth_method == "none"


@pytest.mark.parametrize(
    ("host", "extra", "field"),
    [
        ("alice:pw-in-url-123@127.0.0.1:4222", {}, "Host"),
        (None, {"servers": "nats://127.0.0.1:4222,nats://tok-in-url-456@b:4222"}, "'servers'"),
    ],
)
def test_credentials_in_urls_are_refused_without_repeating_them(host, extra, field) -> None:
    with pytest.raises(ConfigError) as err:
        options_from_connection(
            "nats_url_creds", host=host, port=None, login=None, password=None, extra=extra
        )
    text = str(err.value)
    assert field in text and "Login" in text and "Password" in text, text
    assert "pw-in-url-123" not in text and "tok-in-url-456" not in text


def test_secret_fields_connect_to_real_servers(tmp_path: Path, monkeypatch) -> None:
    """creds_secret against a decentralized-auth server; tls_private_key against mTLS."""
    setup = af.make_decentralized(tmp_path / "jwt")
    pki = af.make_pki(tmp_path / "pki")
    with NatsServer(tmp_path / "jwt-srv", extra_config=setup.server_config) as server:
        monkeypatch.setenv(
            "AIRFLOW_CONN_NATS_CREDS_SECRET",
            json.dumps(
                {
                    "conn_type": "nats",
                    "host": server.url.removeprefix("nats://"),
                    "extra": {"creds_secret": setup.creds_path.read_text()},
                }
            ),
        )
        ok, message = NatsHook("nats_creds_secret").test_connection()
        assert ok, message
    with NatsServer(tmp_path / "tls-srv", extra_config=pki.server_tls_block(verify=True)) as tls:
        monkeypatch.setenv(
            "AIRFLOW_CONN_NATS_TLS_SECRET",
            json.dumps(
                {
                    "conn_type": "nats",
                    "extra": {
                        "servers": tls.url.replace("nats://", "tls://"),
                        "tls_ca": pki.ca_cert.read_text(),
                        "tls_cert": pki.client_cert.read_text(),
                        "tls_private_key": pki.client_key.read_text(),
                    },
                }
            ),
        )
        ok, message = NatsHook("nats_tls_secret").test_connection()
        assert ok, message
