"""A ``nats`` connection's secrets survive the UI's edit round trip, through a real
``airflow api-server`` (issue 30 defect 1).

The UI shows a connection as ``GET /api/v2/connections/{id}`` returns it (secrets as
``***``), its Test button posts the form to ``POST /api/v2/connections/test``, and Save
PATCHes the form back, ``***`` included. Airflow puts the stored value back for a ``***``
only under an extra whose *name* its secrets masker deems sensitive. Before the fix, the
hook read a secret under a former name (``creds``, ``nkey_seed``, ``tls_key``) and, on
Test, registered its value with the api-server's masker: GET then showed ``***``, and Save
stored ``"***"`` over the secret. Now a former name is refused with the rename to make
(nothing read, nothing registered), and every current secret field keeps its value.

Each case connects to a real nats-server that demands that credential."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import authfixtures as af
import pytest
from airflow_api import ApiServer
from cryptography.fernet import Fernet

from airflow_nats_ordered.embedded.servers import NatsServer

PASSWORD = "pw-" + "5c1e" * 6
TOKEN = "tok-" + "9d2b" * 6


class Servers:
    """One nats-server per kind of credential, and the credentials they accept."""

    def __init__(self, base: Path) -> None:
        self.jwt = af.make_decentralized(base / "jwt")
        self.pki = af.make_pki(base / "pki")
        self.nkey = af.new_nkey("user")
        userpass = (
            "authorization { users: [\n"
            f'  {{ user: alice, password: "{PASSWORD}" }},\n'
            f"  {{ nkey: {self.nkey.public} }}\n"
            "] }\n"
        )
        self.creds = NatsServer(base / "creds-srv", extra_config=self.jwt.server_config)
        self.users = NatsServer(base / "users-srv", extra_config=userpass)
        self.token = NatsServer(
            base / "token-srv", extra_config=f'authorization {{ token: "{TOKEN}" }}'
        )
        self.tls = NatsServer(base / "tls-srv", extra_config=self.pki.server_tls_block(verify=True))
        self.all = (self.creds, self.users, self.token, self.tls)

    def connection(self, secret_field: str) -> tuple[dict[str, Any], str]:
        """``(fields of a connection whose secret is under extra or field secret_field,
        the secret)``; the connection works if the hook reads that field."""
        kind = secret_field.removeprefix("extra__nats__")
        if kind in ("creds", "creds_secret"):
            secret = self.jwt.creds_path.read_text()
            return {"host": _hostport(self.creds), "extra": {secret_field: secret}}, secret
        if kind in ("nkey_seed", "nkey_seed_secret"):
            secret = self.nkey.seed
            return {"host": _hostport(self.users), "extra": {secret_field: secret}}, secret
        if kind in ("tls_key", "tls_private_key"):
            secret = self.pki.client_key.read_text()
            extra = {
                "servers": self.tls.url.replace("nats://", "tls://"),
                "tls_ca": self.pki.ca_cert.read_text(),
                "tls_cert": self.pki.client_cert.read_text(),
                secret_field: secret,
            }
            return {"extra": extra}, secret
        if kind == "token":
            return {"host": _hostport(self.token), "extra": {"token": TOKEN}}, TOKEN
        assert kind == "password", kind
        return {"host": _hostport(self.users), "login": "alice", "password": PASSWORD}, PASSWORD


def _hostport(server: NatsServer) -> str:
    return server.url.removeprefix("nats://")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("roundtrip-nats"))
    started = []
    try:
        for server in s.all:
            started.append(server.__enter__())
        yield s
    finally:
        for server in reversed(started):
            server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """The api-server, with the Test button enabled (Airflow's default disables it)."""
    env = {"AIRFLOW__CORE__TEST_CONNECTION": "Enabled"}
    with ApiServer(tmp_path_factory.mktemp("roundtrip-api"), env=env) as server:
        yield server


def _stored(api: ApiServer, conn_id: str) -> dict[str, Any]:
    """What the metadata DB holds for ``conn_id``: password and extra, decrypted."""
    con = sqlite3.connect(f"file:{api.db}?mode=ro", uri=True, timeout=30)
    try:
        row = con.execute(
            "SELECT password, is_encrypted, extra, is_extra_encrypted FROM connection "
            "WHERE conn_id = ?",
            (conn_id,),
        ).fetchone()
    finally:
        con.close()
    assert row is not None, f"{conn_id} is not in the DB"
    fernet = Fernet(os.environ["AIRFLOW__CORE__FERNET_KEY"].encode())

    def clear(value: str | None, encrypted: bool) -> str | None:
        return fernet.decrypt(value.encode()).decode() if value and encrypted else value

    extra = clear(row[2], row[3])
    return {"password": clear(row[0], row[1]), "extra": json.loads(extra) if extra else {}}


def _create(api: ApiServer, conn_id: str, fields: dict[str, Any]) -> None:
    body = {"connection_id": conn_id, "conn_type": "nats", **fields}
    if "extra" in body:
        body["extra"] = json.dumps(body["extra"])
    status, answer = api.request("POST", "/api/v2/connections", body)
    assert status == 201, (status, answer)


def _shown(api: ApiServer, conn_id: str) -> dict[str, Any]:
    """The connection as the UI's form gets it."""
    status, shown = api.request("GET", f"/api/v2/connections/{conn_id}")
    assert status == 200, (status, shown)
    return shown


def _form(shown: dict[str, Any]) -> dict[str, Any]:
    """The body the UI's form posts (Test) or patches (Save): what it was shown."""
    keys = ("connection_id", "conn_type", "description", "host", "login", "schema", "port")
    return {k: shown.get(k) for k in (*keys, "password", "extra")}


def _test(api: ApiServer, body: dict[str, Any]) -> tuple[bool, str]:
    status, answer = api.request("POST", "/api/v2/connections/test", body)
    assert status == 200, (status, answer)
    return answer["status"], answer["message"]


def _save(api: ApiServer, conn_id: str, body: dict[str, Any], description: str) -> None:
    status, answer = api.request(
        "PATCH", f"/api/v2/connections/{conn_id}", {**body, "description": description}
    )
    assert status == 200, (status, answer)


@pytest.mark.parametrize(
    ("old", "new"),
    [("nkey_seed", "nkey_seed_secret"), ("creds", "creds_secret"), ("tls_key", "tls_private_key")],
)
def test_a_secret_under_a_former_name_is_refused_and_survives_test_and_save(
    api: ApiServer, servers: Servers, old: str, new: str
) -> None:
    conn_id = f"nats_former_{old}"
    fields, secret = servers.connection(old)
    _create(api, conn_id, fields)
    form = _form(_shown(api, conn_id))
    tested = _test(api, form)  # the Test button
    shown = _shown(api, conn_id)  # the form, reloaded
    _save(api, conn_id, _form(shown), "edited in the UI")  # Save, as shown

    stored = _stored(api, conn_id)["extra"]
    assert stored.get(old) == secret, (
        f"after Test and Save the DB holds extra {old!r} = {stored.get(old)!r}, "
        f"not the secret (Test said {tested})"
    )
    ok, message = tested
    assert not ok
    assert message.startswith(f"This connection: rename extra '{old}' to '{new}'."), message
    assert secret.strip().splitlines()[-1] not in message
    assert _test(api, _form(_shown(api, conn_id))) == tested  # the same answer again

    # the rename the message asks for, made in the UI's extra editor, works
    renamed = json.loads(shown["extra"])
    renamed[new] = renamed.pop(old)
    _save(api, conn_id, {**_form(shown), "extra": json.dumps(renamed)}, "renamed")
    assert _stored(api, conn_id)["extra"].get(new) == secret
    ok, message = _test(api, _form(_shown(api, conn_id)))
    assert ok, message


@pytest.mark.parametrize(
    "field", ["creds_secret", "nkey_seed_secret", "tls_private_key", "token", "password"]
)
def test_every_secret_field_survives_test_and_save(
    api: ApiServer, servers: Servers, field: str
) -> None:
    conn_id = f"nats_current_{field}"
    fields, secret = servers.connection(field)
    _create(api, conn_id, fields)
    ok, message = _test(api, _form(_shown(api, conn_id)))
    assert ok, message
    shown = _shown(api, conn_id)
    value = shown["password"] if field == "password" else json.loads(shown["extra"])[field]
    assert value == "***"
    assert not [line for line in secret.splitlines() if len(line) > 15 and line in str(shown)]

    _save(api, conn_id, _form(shown), "edited in the UI")
    stored = _stored(api, conn_id)
    held = stored["password"] if field == "password" else stored["extra"][field]
    assert held == secret, f"after Save the DB holds {field} = {held!r}"
    assert _shown(api, conn_id)["description"] == "edited in the UI"
    ok, message = _test(api, _form(_shown(api, conn_id)))
    assert ok, message
