"""Names and server URLs are checked before connecting (issue 15 items 7 and 12), against a
real nats-server: a stream name no partitioned stream can have is a usage error naming
``--stream`` and the allowed characters (it was a traceback and exit 3), and credentials in a
``--server`` URL are refused naming the environment variables to use, without repeating
the secret (``NATS_URL`` may carry them: the environment is not a command line)."""

from __future__ import annotations

import argparse
import os

import pytest
from spark_helpers import on_server

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.embedded.servers import NatsServer

SECRET = "hunter2-pw"


@pytest.fixture(autouse=True)
def _no_nats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)


_COMMANDS = {
    "info": [],
    "provision": ["--partitions", "2"],
    "publish": ["in.jsonl", "--key-field", "k"],
}


@pytest.mark.parametrize("name", ["NOPE.X", "A B", "ORD*", "a/b", ""])
@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_a_stream_name_that_cannot_be_is_a_usage_error_naming_the_flag(
    capsys, tmp_path, monkeypatch, nats_url, command, name
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"k": "a"}\n')
    rc = cli.main([command, "--stream", name, *_COMMANDS[command], "--server", nats_url])
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert "Traceback" not in err, err
    assert f"argument --stream: {name!r} is not a stream name" in err, err
    assert "letters, digits, '_' or '-'" in err, err


def test_python_callers_get_the_rule_too(nats_url):
    with pytest.raises(ConfigError, match=r"stream name 'A B' is not valid: use 1-200"):
        on_server(nats_url, lambda nc: describe(nc, "A B"))


def test_name_types_accept_good_names_and_refuse_a_trailing_newline():
    from airflow_nats_ordered.cli.common import group_name, stream_name

    assert stream_name("ORDERS_v-2") == "ORDERS_v-2"
    assert group_name("billing-1") == "billing-1"
    for check in (stream_name, group_name):
        with pytest.raises(argparse.ArgumentTypeError, match="letters, digits"):
            check("ORDERS\n")
    with pytest.raises(argparse.ArgumentTypeError, match="not a group name"):
        group_name("bill ing")
    with pytest.raises(argparse.ArgumentTypeError, match="not a group name"):
        group_name("g" * 65)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    config = f'authorization {{ user: alice, password: "{SECRET}" }}'
    with NatsServer(tmp_path_factory.mktemp("names-auth"), extra_config=config) as server:
        yield server


@pytest.mark.parametrize(
    ("userinfo", "variables"),
    [(f"alice:{SECRET}", "NATS_USER and NATS_PASSWORD"), (SECRET, "NATS_TOKEN")],
)
def test_credentials_in_a_server_url_are_refused_naming_the_variables(
    capsys, auth_server, unique_name, userinfo, variables
):
    url = f"nats://{userinfo}@127.0.0.1:{auth_server.port}"
    rc = cli.main(["provision", "--stream", unique_name, "--partitions", "1", "--server", url])
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert f"--server nats://***@127.0.0.1:{auth_server.port} carries credentials" in err, err
    assert variables in err, err
    assert SECRET not in out + err


def test_credentials_from_the_environment_connect(capsys, monkeypatch, auth_server, unique_name):
    monkeypatch.setenv("NATS_URL", f"nats://alice:{SECRET}@127.0.0.1:{auth_server.port}")
    assert cli.main(["provision", "--stream", unique_name, "--partitions", "1"]) == 0
    monkeypatch.delenv("NATS_URL")
    monkeypatch.setenv("NATS_PASSWORD", SECRET)
    args = ["--server", auth_server.url, "--user", "alice"]
    assert cli.main(["info", "--stream", unique_name, *args]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err


def test_a_group_name_with_a_trailing_newline_is_refused_by_the_python_api():
    """``re.match`` with ``$`` accepts "g\\n" (``$`` matches before a final newline): the
    group's bucket names would then carry a newline into the server's API subjects."""
    from airflow_nats_ordered.core.errors import ConfigError
    from airflow_nats_ordered.core.group.config import GroupConfig

    with pytest.raises(ConfigError, match="group"):
        GroupConfig("ORDERS", "billing\n")


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["group", "describe"],
        ["worker", "--handler", "m:f"],
        ["pool", "--handler", "m:f"],
        ["group", "delete"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
@pytest.mark.parametrize(
    ("stream", "group", "flag"),
    [("NOPE.X", "g", "--stream"), ("S", "a b", "--group"), ("S", "g.h", "--group")],
)
def test_every_command_refuses_a_bad_stream_or_group_naming_its_flag(
    capsys, argv, stream, group, flag
):
    """One rule, one message, before connecting (the server named here does not exist)."""
    code = cli.main([*argv, "--stream", stream, "--group", group, "--server", "nats://x:1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"argument {flag}:" in err and "is not a" in err, err
