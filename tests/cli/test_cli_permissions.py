"""``nats-ordered permissions`` (issue 31): prints a role's set as a nats-server block or JSON,
without connecting (no server runs here, and bad NATS_* settings do not matter); usage
errors name the flag and the role."""

from __future__ import annotations

import json

import pytest

from airflow_nats_ordered import cli
from airflow_nats_ordered.core import permissions_for


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["permissions", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_conf_block_is_the_function_s(capsys, monkeypatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://user:secret@nowhere:1")  # never read
    code, out, err = _run(capsys, "--role", "worker", "--stream", "ORDERS", "--group", "billing")
    assert code == 0, err
    assert out == permissions_for("worker", "ORDERS", "billing").to_conf()


def test_a_user_entry_and_the_prefixes(capsys) -> None:
    code, out, err = _run(
        capsys,
        *("--role", "publisher", "--stream", "ORDERS", "--user", "orders-pub"),
        *("--js-domain", "hub", "--inbox-prefix", "_INBOX_pub", "--subject-prefix", "eu.o"),
    )
    assert code == 0, err
    want = permissions_for(
        "publisher",
        "ORDERS",
        api_prefix="$JS.hub.API",
        inbox_prefix="_INBOX_pub",
        subject_prefix="eu.o",
    )
    assert out == want.to_conf("orders-pub")
    assert '"$JS.hub.API.STREAM.INFO.ORDERS"' in out and '"eu.o.p.*"' in out


def test_json_for_tooling(capsys) -> None:
    code, out, err = _run(
        capsys,
        *("--role", "watcher", "--stream", "ORDERS", "--group", "billing"),
        *("--format", "json", "--user", "airflow", "--js-api-prefix", "$JS.x.API"),
    )
    assert code == 0, err
    doc = json.loads(out)
    want = permissions_for("watcher", "ORDERS", "billing", api_prefix="$JS.x.API").to_json()
    assert doc == {"user": "airflow", **want}


def test_the_broad_operator_is_said_on_stderr(capsys) -> None:
    code, out, err = _run(capsys, "--role", "operator", "--stream", "ORDERS")
    assert code == 0
    assert '"$JS.API.>"' in out
    assert "without --group grants the account's whole JetStream API" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "worker", "--stream", "ORDERS"], "--role worker needs --group G"),
        (["--role", "reader", "--stream", "ORDERS"], "--role reader needs --group G"),
        (["--role", "admin", "--stream", "ORDERS"], "argument --role: invalid choice: 'admin'"),
        (["--role", "worker", "--stream", "A.B", "--group", "g"], "argument --stream:"),
        (["--role", "worker", "--stream", "S", "--group", "a b"], "argument --group:"),
        (
            ["--role", "worker", "--stream", "S", "--group", "g", "--js-domain", "a.b"],
            "argument --js-domain: --js-domain 'a.b' is not valid",
        ),
        (
            [
                "--role",
                "publisher",
                "--stream",
                "S",
                "--js-domain",
                "d",
                "--js-api-prefix",
                "$JS.d.API",
            ],
            "argument --js-api-prefix: not allowed with argument --js-domain",
        ),
        (
            ["--role", "publisher", "--stream", "S", "--inbox-prefix", "_INBOX.>"],
            "argument --inbox-prefix: --inbox-prefix '_INBOX.>' is not valid",
        ),
        (
            ["--role", "publisher", "--stream", "S", "--subject-prefix", "a..b"],
            "argument --subject-prefix: --subject-prefix 'a..b' is not valid",
        ),
        (
            ["--role", "publisher", "--stream", "S", "--user", "a b"],
            "argument --user: --user 'a b' is not valid",
        ),
        (
            ["--role", "publisher", "--stream", "S", "--server", "nats://x:1"],
            "unrecognized arguments: --server",
        ),
        (  # the publisher acts for no group: a --group would head a block it does not shape
            ["--role", "publisher", "--stream", "S", "--group", "G"],
            "error: --role publisher takes no --group",
        ),
    ],
)
def test_usage_errors_name_the_flag(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2, (out, err)
    assert message in err, err
    assert out == ""
