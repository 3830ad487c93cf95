"""A refused permission, as ``nats-ordered`` says it: the refused subject, the flag that gave
the user and the role the command acts in, with the command printing that role's set."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from permission_accounts import PASSWORD, S, accounts_config, options

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.embedded.servers import NatsServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("cli-denials"), extra_config=accounts_config()) as srv:

        async def setup() -> None:
            nc = await connect(options(srv, "admin_a"))
            try:
                await provision(nc, StreamSpec(S, partitions=4))
            finally:
                await nc.close()

        asyncio.run(setup())
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
