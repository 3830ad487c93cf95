"""``inbox_prefix`` and ``js_domain`` against real servers (issue 31 item 4).

* A user whose permissions deny subscribing to ``_INBOX.>`` (and allow ``_MYINBOX.>``)
  publishes a run, runs a worker to the end and reads the stream in global order with
  ``inbox_prefix="_MYINBOX"``; without it the first JetStream request is refused (the
  server reports the subscription violation, the request times out).
* A hub and a leaf node on loopback, the leaf running JetStream in domain ``leaf``: a client
  of the HUB with ``js_domain="leaf"`` provisions the stream, publishes a run (run ledger
  and watermarks in KV), a worker commits (the group's KV state), the group drains and a
  global-order reader reads the run in publish order, all on the leaf;
  the CLI shows it drained with ``--js-domain leaf``. The hub has none of it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import nats
import pytest
from leaf_domain import jetstream_block, wait_linked
from nats.js.errors import NotFoundError

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.connection.api import api_prefix, inbox_prefix, jetstream
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import PermissionDenied
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.runs import ledger_bucket, publish_run
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool
from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.inputs.records import InputRecord

N = 60  # records per run: enough for every partition, quick
WAIT = 30.0


def _records(n: int = N) -> list[InputRecord]:
    return [InputRecord(f"k{i % 12}", json.dumps({"i": i}).encode(), None, "") for i in range(n)]


def _cfg(stream: str) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2)


async def _work_until_drained(options: ConnectionOptions, nc, stream: str) -> list[int]:
    seen: list[int] = []

    async def handler(msg) -> None:
        seen.append(json.loads(msg.data)["i"])

    async with WorkerPool(options, _cfg(stream), handler, size=1):
        await wait_drained(nc, stream, "g", timeout=WAIT)
    return seen


async def _read_in_global_order(nc, stream: str) -> list[GlobalMessage]:
    got: list[GlobalMessage] = []
    reader = GlobalOrderReader(nc, stream, "audit", got.append)
    await reader.start()
    try:
        async with asyncio.timeout(WAIT):
            while len(got) < N:
                await asyncio.sleep(0.02)
    finally:
        await reader.stop()
    return got


# ---------------------------------------------------------------------------- inbox prefix


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A server whose one user may do anything but subscribe to ``_INBOX.>``."""
    config = """
authorization {
  users = [
    { user: locked, password: "pw-locked",
      permissions: { publish: { allow: [">"] },
                     subscribe: { allow: [">"], deny: ["_INBOX.>"] } } }
  ]
}
"""
    with NatsServer(tmp_path_factory.mktemp("locked"), extra_config=config) as server:
        yield server


def _locked(server: NatsServer, **kw) -> ConnectionOptions:
    return ConnectionOptions(servers=(server.url,), user="locked", password="pw-locked", **kw)


def test_a_user_denied_INBOX_publishes_works_and_reads_with_its_own_inbox_prefix(  # noqa: N802
    locked_server: NatsServer, unique_name: str
) -> None:
    options = _locked(locked_server, inbox_prefix="_MYINBOX")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async def go():
        nc = await connect(options, error_cb=on_error)
        try:
            assert inbox_prefix(nc) == "_MYINBOX"
            await provision(nc, StreamSpec(unique_name, partitions=3))
            run = await publish_run(
                nc,
                unique_name,
                _records(),
                producer_id="run-1",
                config=PublisherConfig(global_order=GlobalOrder()),
            )
            seen = await _work_until_drained(options, nc, unique_name)
            lag = await read_lag(nc, unique_name, "g")
            got = await _read_in_global_order(nc, unique_name)
            return run, seen, lag, got
        finally:
            await nc.close()

    run, seen, lag, got = asyncio.run(go())
    assert run.record.status == "complete" and run.record.acked == N
    assert sorted(set(seen)) == list(range(N))
    assert lag.drained and lag.total_lag == 0
    assert [json.loads(m.data)["i"] for m in got] == list(range(N))  # publish order
    assert not [e for e in errors if "permissions violation" in e.lower()], errors


def test_without_the_inbox_prefix_the_same_user_is_refused_its_replies(
    locked_server: NatsServer,
) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async def go() -> BaseException:
        nc = await connect(_locked(locked_server), error_cb=on_error)
        try:
            # refused at once, naming the inbox (not a request timeout: core.connection.denials)
            with pytest.raises(PermissionDenied) as err:
                await jetstream(nc, timeout=1.0).account_info()
            assert err.value.operation == "subscribe"
            assert err.value.grant == "_INBOX.>"
            async with asyncio.timeout(WAIT):
                while not errors:
                    await asyncio.sleep(0.02)
            return err.value
        finally:
            await nc.close()

    asyncio.run(go())
    # nats-py lowercases the server's -ERR 'Permissions Violation for Subscription to ...'
    assert any('permissions violation for subscription to "_inbox.' in e.lower() for e in errors), (
        errors
    )


def test_the_cli_names_the_inbox_prefix_flag_when_the_reply_subscription_is_refused(
    locked_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NATS_PASSWORD", "pw-locked")
    argv = ["provision", "--stream", unique_name, "--partitions", "2"]
    argv += ["--server", locked_server.url, "--user", "locked"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "permission denied: subscribe to _INBOX." in err, err
    assert "pass --inbox-prefix PREFIX" in err
    assert cli.main([*argv, "--inbox-prefix", "_MYINBOX"]) == 0, capsys.readouterr().err


# ---------------------------------------------------------------------------- JetStream domain


@dataclass
class _HubAndLeaf:
    hub: NatsServer
    leaf: NatsServer


@pytest.fixture(scope="module")
def hub_and_leaf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_HubAndLeaf]:
    """A hub (JetStream domain ``hub``) and a leaf node connected to it on loopback, the
    leaf's JetStream in domain ``leaf``; ready once a client of the hub reaches the leaf's
    JetStream through the domain."""
    root = tmp_path_factory.mktemp("domains")
    leaf_port = free_port()

    hub = NatsServer(
        root / "hub",
        name="hub",
        jetstream=False,  # its own block below, with the domain
        extra_config=jetstream_block(root / "hub", "hub")
        + f'leafnodes {{ listen: "127.0.0.1:{leaf_port}" }}\n',
    )
    leaf = NatsServer(
        root / "leaf",
        name="leaf",
        jetstream=False,
        extra_config=jetstream_block(root / "leaf", "leaf")
        + f'leafnodes {{ remotes: [ {{ url: "nats://127.0.0.1:{leaf_port}" }} ] }}\n',
    )
    with hub, leaf:
        wait_linked(hub.url, "leaf", WAIT)
        yield _HubAndLeaf(hub, leaf)


def test_a_client_of_the_hub_runs_the_pipeline_in_the_leafs_domain(
    hub_and_leaf: _HubAndLeaf, unique_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ConnectionOptions(servers=(hub_and_leaf.hub.url,), js_domain="leaf")
    stream = unique_name

    async def go():
        nc = await connect(options)
        try:
            assert api_prefix(nc) == "$JS.leaf.API"
            await provision(nc, StreamSpec(stream, partitions=3))
            run = await publish_run(
                nc,
                stream,
                _records(),
                producer_id="run-1",
                config=PublisherConfig(global_order=GlobalOrder()),  # watermarks in KV too
            )
            seen = await _work_until_drained(options, nc, stream)
            lag = await read_lag(nc, stream, "g")
            got = await _read_in_global_order(nc, stream)
            return run, seen, lag, got
        finally:
            await nc.close()

    async def where_it_lives() -> tuple[dict[str, int], list[str]]:
        """Stream and buckets as each server's own JetStream sees them (no domain)."""
        names = [stream, f"KV_{GroupConfig(stream, 'g').state_bucket}"]
        names.append(f"KV_{ledger_bucket(stream)}")
        on_leaf: dict[str, int] = {}
        on_hub: list[str] = []
        leaf_nc = await nats.connect(hub_and_leaf.leaf.url)
        hub_nc = await nats.connect(hub_and_leaf.hub.url)
        try:
            for name in names:
                info = await leaf_nc.jetstream().stream_info(name)
                on_leaf[name] = info.state.messages
                try:
                    await hub_nc.jetstream().stream_info(name)
                    on_hub.append(name)
                except NotFoundError:
                    pass
        finally:
            await leaf_nc.close()
            await hub_nc.close()
        return on_leaf, on_hub

    run, seen, lag, got = asyncio.run(go())
    assert run.record.status == "complete" and run.record.acked == N
    assert sorted(set(seen)) == list(range(N))
    assert lag.drained and lag.total_lag == 0
    assert [json.loads(m.data)["i"] for m in got] == list(range(N))  # publish order
    on_leaf, on_hub = asyncio.run(where_it_lives())
    assert on_leaf[stream] >= N and all(on_leaf.values()), on_leaf  # commits, ledger stored
    assert on_hub == []
    # the CLI, connected to the hub, sees the group drained in the leaf's domain
    rc = cli.main(
        ["status", "--stream", stream, "--group", "g", "--server", hub_and_leaf.hub.url]
        + ["--js-domain", "leaf", "--json"]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["drained"] is True
