"""docs/connection.md is what the ``nats`` connection is (issue 16 item 10).

Its field table lists exactly the connection form's fields (the provider info) and marks as
secret exactly the fields Airflow hides; every ``airflow connections add``/``import``
command and every ``AIRFLOW_CONN_*`` value it shows is run against the test session's
Airflow home (in-process, through Airflow's own CLI parser, under a connection id of this
test's) and read back by ``NatsHook``; ``airflow connections test`` runs against a real
nats-server.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from airflow_processes import metadata_db
from locations import ROOT

from airflow_nats_ordered import get_provider_info
from airflow_nats_ordered.hooks.connection_secrets import RENAMED_SECRET_EXTRAS, SECRET_EXTRAS
from airflow_nats_ordered.hooks.nats import options_from_connection

PAGE = ROOT / "docs" / "connection.md"
TEXT = PAGE.read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", TEXT, flags=re.M | re.S)


def _commands(prefix: str) -> list[str]:
    """Complete shell lines of the page's bash blocks starting with ``prefix`` (with their
    ``\\`` continuations joined)."""
    out = []
    for block in _blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.startswith(prefix):
                out.append(line)
    return out


def _table() -> dict[str, tuple[str, str]]:
    """field -> (form label, secret column) from the page's field table."""
    rows = {}
    for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \| [^|]* \| (yes|no) \|", TEXT, flags=re.M):
        rows[m.group(1)] = (m.group(2).strip(), m.group(3))
    return rows


def _airflow_cli(words: list[str]) -> None:
    from airflow.cli import cli_parser

    args = cli_parser.get_parser().parse_args(words)
    args.func(args)


def _read(conn_id: str) -> Any:
    """The connection as the provider reads it (Airflow 3's SDK lookup outside a task does
    not ask the metadata database, so it is read as the CLI's --conn-id reads it)."""
    from airflow.models import Connection

    conn = Connection.get_connection_from_secrets(conn_id)
    return options_from_connection(
        conn_id,
        host=conn.host,
        port=conn.port,
        login=conn.login,
        password=conn.password,
        extra=conn.extra_dejson,
    )


@pytest.fixture
def etc_nats(tmp_path: Path) -> Path:
    """The files the page names under /etc/nats/, for a test that replaces that folder."""
    (tmp_path / "ca.pem").write_text("placeholder\n")
    (tmp_path / "airflow.creds").write_text(  # the shape of `nsc generate creds` output
        "-----BEGIN NATS USER JWT-----\nplaceholder.jwt\n------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\nSUplaceholder\n------END USER NKEY SEED------\n"
    )
    return tmp_path


def _local(text: str, etc_nats: Path) -> str:
    return text.replace("/etc/nats/", f"{etc_nats}/").replace(
        "%2Fetc%2Fnats%2F", quote(f"{etc_nats}/", safe="")
    )


def _delete(conn_id: str) -> None:
    from airflow.models import Connection
    from airflow.utils.session import create_session

    with create_session() as session:
        session.query(Connection).filter(Connection.conn_id == conn_id).delete()


@pytest.fixture
def conn_id() -> Any:
    metadata_db()
    name = f"doc_{uuid.uuid4().hex[:10]}"
    yield name
    _delete(name)


def test_the_field_table_is_the_connection_form_and_marks_the_hidden_secrets() -> None:
    (conn_type,) = get_provider_info()["connection-types"]
    form = conn_type["conn-fields"]
    table = _table()
    assert set(table) == {"host", "port", "login", "password", "schema", *form}
    for name, field in form.items():
        assert table[name][0] == field["label"], name
    secret = {k for k, (_, s) in table.items() if s == "yes"}
    assert secret == {"password", *SECRET_EXTRAS}
    assert {k for k, f in form.items() if f["schema"].get("format") == "password"} == set(
        SECRET_EXTRAS
    )
    for old, new in RENAMED_SECRET_EXTRAS.items():
        assert f"`{old}`" in TEXT and f"`{new}`" in TEXT


def test_the_page_shows_the_commands_this_test_runs() -> None:
    assert len(_commands("airflow connections add ")) == 2
    assert len(_commands("airflow connections import ")) == 1
    assert len(_commands("export AIRFLOW_CONN_")) == 2
    assert len(_commands("AIRFLOW__CORE__TEST_CONNECTION=Enabled airflow connections test")) == 1


@pytest.mark.parametrize("command", _commands("airflow connections add "))
def test_connections_add_commands_make_a_connection_the_hook_reads(
    command: str, conn_id: str, etc_nats: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words = shlex.split(_local(command, etc_nats))[1:]
    assert words[2] == "nats_default"
    words[2] = conn_id
    _airflow_cli(words)
    assert f"Successfully added `conn_id`={conn_id}" in capsys.readouterr().out
    options = _read(conn_id)
    assert list(options.servers) == ["nats://nats-1:4222", "nats://nats-2:4222"]
    extra = json.loads(words[words.index("--conn-extra") + 1]) if "--conn-extra" in words else {}
    if "--conn-json" in words:
        extra = json.loads(words[words.index("--conn-json") + 1])["extra"]
    for key, value in extra.items():
        assert getattr(options, key) == value, key


def test_connections_import_of_the_json_file_makes_the_connection(
    conn_id: str, tmp_path: Path, etc_nats: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (command,) = _commands("airflow connections import ")
    (document,) = [_local(b, etc_nats) for b in _blocks("json")]
    value = json.loads(document)["nats_default"]
    path = tmp_path / shlex.split(command)[-1]
    path.write_text(json.dumps({conn_id: value}))
    _airflow_cli([*shlex.split(command)[1:-1], str(path)])
    assert f"Imported connection {conn_id}" in capsys.readouterr().out
    options = _read(conn_id)
    assert list(options.servers) == ["tls://nats-1:4222", "tls://nats-2:4222"]
    assert (options.user, options.password) == ("airflow", "change-me")
    assert options.tls_ca_file == f"{etc_nats}/ca.pem"
    assert options.max_reconnect_attempts == -1


@pytest.mark.parametrize("command", _commands("export AIRFLOW_CONN_"))
def test_airflow_conn_variables_make_a_connection_the_hook_reads(
    command: str, etc_nats: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = shlex.split(_local(command, etc_nats).removeprefix("export "))
    name, _, value = words[0].partition("=")
    assert name == "AIRFLOW_CONN_NATS_DEFAULT"
    conn_id = f"doc_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", value)
    options = _read(conn_id)
    assert options.servers[0] == "nats://nats-1:4222"
    if value.startswith("{"):
        assert options.creds_file == f"{etc_nats}/airflow.creds"
    else:
        assert (options.connect_timeout, options.tls_ca_file) == (10, f"{etc_nats}/ca.pem")


def test_connections_test_command_reports_success_against_a_server(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (command,) = _commands("AIRFLOW__CORE__TEST_CONNECTION=Enabled airflow connections test")
    env, *words = shlex.split(command)
    conn_id = f"doc_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(*env.split("=", 1))
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "nats", "host": nats_url})
    )
    assert words[-1] == "nats_default"
    _airflow_cli([*words[1:-1], conn_id])
    assert "Connection success!" in capsys.readouterr().out


def test_what_the_connections_cli_prints_is_what_the_page_says(
    conn_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """add hides the secret extras, list hides values unless asked, get shows them, and
    list --show-values --hide-sensitive still shows the extras in its get_uri column (Airflow
    3.3 masks only a URI's user:password; the page warns of it: when Airflow changes this,
    this test fails and the page is brought up to date)."""
    token = "tok-" + uuid.uuid4().hex
    extra = json.dumps({"token": token, "name": "doc-check"})
    _airflow_cli(["connections", "add", conn_id, "--conn-type", "nats", "--conn-extra", extra])
    added = capsys.readouterr().out
    assert "doc-check" in added and token not in added and "***" in added
    _airflow_cli(["connections", "list", "-o", "json"])
    assert token not in capsys.readouterr().out
    _airflow_cli(["connections", "list", "--show-values", "--hide-sensitive", "-o", "json"])
    (row,) = [r for r in json.loads(capsys.readouterr().out) if r["conn_id"] == conn_id]
    assert token not in json.dumps(row["extra_dejson"]) and token in row["get_uri"]
    _airflow_cli(["connections", "get", conn_id, "-o", "json"])
    assert token in capsys.readouterr().out
    text = " ".join(TEXT.split())
    assert "`airflow connections get` and `airflow connections export` print everything" in text
    assert "still prints the extras, secrets included, in its `get_uri` column" in text
