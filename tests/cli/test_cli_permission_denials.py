"""A refused permission, as ``nats-ordered`` says it: the refused subject, the flag that gave
the user and the role the command acts in, with the command printing that role's set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from permission_accounts import PASSWORD, S, accounts_config, provisioned_server, reload

from airflow_nats_ordered import cli
from airflow_nats_ordered.embedded.servers import NatsServer

CLI = [sys.executable, "-m", "airflow_nats_ordered.cli"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with provisioned_server(tmp_path_factory.mktemp("cli-denials")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("NATS_PASSWORD", PASSWORD)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_provision_as_a_worker_names_the_flag_and_the_operator_role(
    server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _run(
        capsys, "provision", "--stream", S, "--partitions", "4", "--max-age", "1d",
        "-s", server.url, "--user", "worker_a",
    )  # fmt: skip
    assert rc == 2, err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert "permission denied: publish to $JS.API." in line
    assert "for the user given by --user worker_a (NATS_USER)" in line
    assert (
        f"the operator role needs it: run `nats-ordered permissions --role operator --stream {S}`"
        in line
    )
    assert PASSWORD not in err


def test_publish_as_a_worker_names_the_partition_and_the_publisher_role(
    server: NatsServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps({"k": f"k{i}", "n": i}) + "\n" for i in range(3)))
    rc, err = _run(
        capsys, "publish", "--stream", S, str(records), "--key-field", "k", "-s", server.url,
        "--user", "worker_a",
    )  # fmt: skip
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: permission denied: publish to orders.p."), line
    assert "--user worker_a" in line
    assert f"run `nats-ordered permissions --role publisher --stream {S}`" in line


def test_worker_as_a_publisher_names_the_worker_role_and_its_group(
    server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _run(
        capsys, "worker", "--stream", S, "--group", "G", "--handler", "builtins:print",
        "-s", server.url, "--user", "pub_a",
    )  # fmt: skip
    assert rc == 2, err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert "permission denied: publish to $JS.API.STREAM.INFO.KV_nor_ORDERS_G_" in line
    assert "--user pub_a" in line
    assert f"run `nats-ordered permissions --role worker --stream {S} --group G`" in line


def test_status_of_a_group_as_a_publisher_names_the_watcher_role(
    server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """One group's status (``--wait-drained`` too) is the drain sensor's read: the watcher's
    role, not the operator's (as the explorer's least-privilege mode runs it)."""
    rc, err = _run(
        capsys, "status", "--stream", S, "--group", "G", "-s", server.url, "--user", "pub_a",
    )  # fmt: skip
    assert rc == 2, err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert "permission denied: " in line
    assert f"run `nats-ordered permissions --role watcher --stream {S} --group G`" in line


def test_worker_that_loses_a_permission_stops_naming_it(server: NatsServer) -> None:
    """A joined ``nats-ordered worker`` whose user loses the right to write its leases stops
    once, exit 3, with the refusal in the CLI's terms (not a warning a second for ever)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["NATS_PASSWORD"] = PASSWORD
    argv = [
        *CLI, "worker", "--stream", S, "--group", "G", "--handler", "builtins:print",
        "--lease-ttl", "3", "-s", server.url, "--user", "revocable_a",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # until it joined
            lines.append(line)
            if "joined group G" in line or time.monotonic() > deadline:
                break
        assert any("joined group G" in x for x in lines), "".join(lines)
        reload(server, accounts_config(revoked=True))
        rc = proc.wait(timeout=60)
        lines += proc.stderr.readlines()
    finally:
        reload(server, accounts_config())
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines)
    assert rc == 3, err
    final = [x for x in lines if x.startswith("error: member")]
    assert final, err
    assert f"stopped: permission denied: publish to $KV.nor_{S}_G_leases." in final[-1]
    assert "--user revocable_a" in final[-1]
    assert f"--role worker --stream {S} --group G" in final[-1]


def test_a_refused_reply_inbox_names_the_inbox_to_allow(
    server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request's answer comes on the client's inbox: refused, the command fails at
    once naming the inbox prefix to allow (not "the server did not answer in time")."""
    rc, err = _run(capsys, "info", "--stream", S, "-s", server.url, "--user", "noinbox_a")
    assert rc == 2, err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert line.startswith("error: permission denied: subscribe to _INBOX."), line
    assert "(allow _INBOX.>) for the user given by --user noinbox_a" in line
    assert "or pass --inbox-prefix PREFIX (NATS_INBOX_PREFIX" in line
