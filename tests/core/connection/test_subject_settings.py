"""``inbox_prefix``, ``js_domain`` and ``js_api_prefix`` as settings (issue 31 item 4):
validated with errors naming the option (the CLI flag, the environment variable), shown by
``describe()``, taken from Airflow-style mappings, the environment and the CLI's flags,
passed to the pool's members, and turned into the subjects a client uses."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from airflow_nats_ordered import cli
from airflow_nats_ordered.cli.common import add_connection_flags, connection_options
from airflow_nats_ordered.cli.pool import configure as configure_pool
from airflow_nats_ordered.cli.pool import member_argv
from airflow_nats_ordered.core.connection.api import (
    api_prefix,
    api_subject,
    inbox_prefix,
    jetstream,
    kv_subject,
)
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.environment import resolve, spark_env
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_nats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inbox_prefix": "_MY INBOX"}, r"'_MY INBOX' is not a subject prefix.*blanks"),
        ({"inbox_prefix": "_MY.>"}, r"inbox_prefix '_MY.>' is not a subject prefix.*wildcards"),
        ({"inbox_prefix": "a..b"}, r"inbox_prefix 'a..b' .*empty token"),
        ({"js_domain": "leaf.one"}, r"js_domain 'leaf.one' is not a JetStream domain name"),
        ({"js_domain": "le*f"}, r"js_domain 'le\*f' is not a JetStream domain name"),
        ({"js_api_prefix": "JS.*.API"}, r"js_api_prefix 'JS.\*.API' .*wildcards"),
        ({"js_domain": "leaf", "js_api_prefix": "JS.x.API"}, r"both js_domain and js_api_prefix"),
    ],
)
def test_bad_values_are_refused_naming_the_option(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        ConnectionOptions(**kwargs)
    assert getattr(err.value, "field", None) in kwargs


def test_values_are_normalised_shown_and_give_the_api_prefix() -> None:
    plain = ConnectionOptions()
    assert plain.api_prefix == "$JS.API" and "inbox_prefix" not in plain.describe()
    assert "inbox_prefix" not in plain.nats_connect_kwargs()
    opts = ConnectionOptions(inbox_prefix="_MYINBOX.", js_domain="leaf")
    assert (opts.inbox_prefix, opts.api_prefix) == ("_MYINBOX", "$JS.leaf.API")
    assert opts.describe().endswith(" inbox_prefix=_MYINBOX js_domain=leaf")
    assert opts.nats_connect_kwargs()["inbox_prefix"] == "_MYINBOX"
    assert ConnectionOptions(js_api_prefix="JS.hub.API.").api_prefix == "JS.hub.API"
    # Airflow extras style: strings, empty means unset
    mapped = ConnectionOptions.from_mapping(
        {"inbox_prefix": "_I", "js_domain": "", "js_api_prefix": "JS.a.API"}
    )
    assert (mapped.inbox_prefix, mapped.js_domain, mapped.api_prefix) == ("_I", None, "JS.a.API")


def test_environment_variables_and_overrides() -> None:
    env = {"NATS_INBOX_PREFIX": "_ENV", "NATS_JS_DOMAIN": "leaf"}
    opts = ConnectionOptions.from_env(env)
    assert (opts.inbox_prefix, opts.api_prefix) == ("_ENV", "$JS.leaf.API")
    # an override of one of domain / API prefix replaces both from the environment
    assert ConnectionOptions.from_env(env, js_api_prefix="JS.x.API").api_prefix == "JS.x.API"
    with pytest.raises(ConfigError, match=r"from environment variable NATS_JS_DOMAIN"):
        ConnectionOptions.from_env({"NATS_JS_DOMAIN": "a.b"})
    with pytest.raises(ConfigError, match=r"NATS_INBOX_PREFIX"):
        ConnectionOptions.from_env({"NATS_INBOX_PREFIX": "_A.*"})
    # the Spark driver's environment: the same variables, written back by spark_env
    assert resolve(spark_env(opts)) == opts
    assert resolve(env, {"js_api_prefix": "JS.y.API"}).api_prefix == "JS.y.API"


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nats-ordered status")
    add_connection_flags(p)
    return p.parse_args(argv)


def test_cli_flags_override_the_environment() -> None:
    args = _parse("--inbox-prefix", "_FLAG", "--js-api-prefix", "JS.hub.API")
    opts = connection_options(args, {"NATS_JS_DOMAIN": "leaf", "NATS_INBOX_PREFIX": "_ENV"})
    assert (opts.inbox_prefix, opts.js_domain, opts.api_prefix) == ("_FLAG", None, "JS.hub.API")
    opts = connection_options(_parse(), {"NATS_JS_DOMAIN": "leaf", "NATS_INBOX_PREFIX": "_E"})
    assert (opts.inbox_prefix, opts.api_prefix) == ("_E", "$JS.leaf.API")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--inbox-prefix", "_MY INBOX"], "argument --inbox-prefix: '_MY INBOX' is not a subject"),
        (["--js-domain", "a.b"], "argument --js-domain: 'a.b' is not a JetStream domain name"),
        (["--js-api-prefix", "JS.>"], "argument --js-api-prefix: 'JS.>' is not a subject prefix"),
        (
            ["--js-domain", "leaf", "--js-api-prefix", "JS.x.API"],
            "argument --js-api-prefix: not allowed with argument --js-domain",
        ),
    ],
)
def test_cli_bad_flags_are_usage_errors_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert cli.main(["status", "--stream", "S", "--group", "g", *argv]) == 2  # usage error
    assert expected in capsys.readouterr().err


def test_cli_bad_environment_variable_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_JS_DOMAIN", "no.dots")
    assert cli.main(["status", "--stream", "S", "--group", "g"]) == 2
    err = capsys.readouterr().err
    assert "js_domain 'no.dots' is not a JetStream domain name" in err
    assert "(from environment variable NATS_JS_DOMAIN)" in err


def test_pool_members_get_the_settings() -> None:
    p = argparse.ArgumentParser()
    configure_pool(p)
    add_connection_flags(p)
    args = p.parse_args(
        ["--stream", "S", "--group", "g", "--handler", "m:f", "--size", "2"]
        + ["--inbox-prefix", "_POOL", "--js-domain", "leaf"]
    )
    argv = member_argv(args)
    assert argv[argv.index("--inbox-prefix") + 1] == "_POOL"
    assert argv[argv.index("--js-domain") + 1] == "leaf"
    assert "--js-api-prefix" not in argv


def test_the_client_remembers_its_subjects(nats_url: str) -> None:
    async def go():
        plain = await connect(ConnectionOptions(servers=(nats_url,)))
        domain = await connect(
            ConnectionOptions(servers=(nats_url,), inbox_prefix="_X", js_domain="d")
        )
        try:
            return (
                (api_prefix(plain), inbox_prefix(plain), api_subject(plain, "INFO")),
                (api_prefix(domain), inbox_prefix(domain), api_subject(domain, "INFO")),
                kv_subject(plain, "b", "k"),
                kv_subject(domain, "b", "k"),
                jetstream(domain)._prefix,
                jetstream(domain, domain="other")._prefix,
                domain.new_inbox().startswith("_X."),
            )
        finally:
            await plain.close()
            await domain.close()

    plain, domain, kv_plain, kv_domain, js_prefix, explicit, inbox_ok = asyncio.run(go())
    assert plain == ("$JS.API", "_INBOX", "$JS.API.INFO")
    assert domain == ("$JS.d.API", "_X", "$JS.d.API.INFO")
    assert (kv_plain, kv_domain) == ("$KV.b.k", "$JS.d.API.$KV.b.k")
    assert (js_prefix, explicit, inbox_ok) == ("$JS.d.API", "$JS.other.API", True)
