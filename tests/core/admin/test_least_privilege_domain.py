"""Least privilege under a JetStream domain (issue 31): the roles' sets from
``permissions_for(..., api_prefix=js_api_prefix("leaf"))`` run their jobs from a HUB whose
users have exactly those sets, against the JetStream of a leaf node in domain ``leaf``.

The hub has an account ``TEAM_A`` holding one user per role (each entry is the
``to_conf(user)`` block itself) and the leaf node's remote user; the leaf node connects to
the hub as that user and runs JetStream in domain ``leaf`` for it. The remote user has only
what docs/security.md says it needs (``LEAF_PERMISSIONS``): a subscribe permission it lacks
is not logged as a violation, the hub just forwards nothing (records, API requests), so the
job itself is the proof. Over the hub, with
``js_domain="leaf"``: the operator provisions, the publisher publishes a run (its ledger in
KV: writes through ``$JS.leaf.API.$KV...``), a worker processes every record and commits,
the watcher's drain check sees the group drained and its ``nats://`` watcher reads and acks
(acks cross the leaf connection). No permission violation: neither in our connections'
error_cb nor in either server's log.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from leaf_domain import jetstream_block, wait_linked

from airflow_nats_ordered.core import (
    ConnectionOptions,
    StreamSpec,
    Worker,
    WorkerConfig,
    connect,
    permissions_for,
    provision,
    publish_run,
)
from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.admin.permissions import js_api_prefix
from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.inputs.records import InputRecord

WAIT = 30.0
STREAM = "ORDERS"
GROUP = "g"
ROLES = {"d_operator": "operator", "d_publisher": "publisher", "d_worker": "worker"}
ROLES["d_watcher"] = "watcher"

#: what the leaf node's remote user on the hub needs (docs/security.md): to be sent the
#: domain's API requests, acknowledgements and flow-control answers, and to send the
#: replies and deliveries back to the clients' inboxes
LEAF_PERMISSIONS = json.dumps(
    {
        "publish": {"allow": ["_INBOX.>"]},
        "subscribe": {"allow": ["$JS.leaf.API.>", "$JS.ACK.>", "$JS.FC.>", "orders.>"]},
    }
)


@dataclass
class Domain:
    hub: NatsServer
    leaf: NatsServer
    passwords: dict[str, str]
    errors: list[str]

    def options(self, user: str) -> ConnectionOptions:
        return ConnectionOptions(
            servers=(self.hub.url,),
            user=user,
            password=self.passwords[user],
            js_domain="leaf",
            name=user,
        )

    async def connect(self, user: str) -> Any:
        async def on_error(exc: Exception) -> None:
            self.errors.append(f"{user}: {exc}")

        return await connect(self.options(user), error_cb=on_error)

    def violations(self) -> list[str]:
        found = [e for e in self.errors if "violation" in e.lower()]
        for server in (self.hub, self.leaf):
            log = server.log_path.read_text(errors="replace")
            found += [ln for ln in log.splitlines() if "[ERR]" in ln and "Violation" in ln]
        return found


@pytest.fixture(scope="module")
def domain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Domain]:
    root = tmp_path_factory.mktemp("domain-least-privilege")
    api = js_api_prefix("leaf")
    passwords = {user: secrets.token_hex(8) for user in [*ROLES, "leaf"]}
    entries = [
        permissions_for(role, STREAM, GROUP, api_prefix=api).to_conf(user)
        for user, role in ROLES.items()
    ]
    variables = "".join(f"{u.upper()}_PASSWORD: {json.dumps(p)}\n" for u, p in passwords.items())
    leaf_port = free_port()
    hub_config = (
        variables
        + "accounts {\n  SYS { users = [ { user: sys, password: "
        + json.dumps(secrets.token_hex(8))
        + " } ] }\n  TEAM_A {\n    users = [\n"
        + "\n".join(entries)
        + "\n      { user: leaf, password: $LEAF_PASSWORD, permissions: "
        + LEAF_PERMISSIONS
        + " }\n    ]\n  }\n}\n"
        + "system_account: SYS\n"
        + jetstream_block(root / "hub", "hub")
        + f'leafnodes {{ listen: "127.0.0.1:{leaf_port}" }}\n'
    )
    if os.environ.get("NATS_ORDERED_TRACE_PERMISSIONS"):  # exploring: log every PUB/SUB
        hub_config += "trace: true\n"
    remote = f"nats://leaf:{passwords['leaf']}@127.0.0.1:{leaf_port}"
    hub = NatsServer(root / "hub", name="hub", jetstream=False, extra_config=hub_config)
    leaf = NatsServer(
        root / "leaf",
        name="leaf",
        jetstream=False,
        extra_config=jetstream_block(root / "leaf", "leaf")
        + f"leafnodes {{ remotes: [ {{ url: {json.dumps(remote)} }} ] }}\n",
    )
    with hub, leaf:
        wait_linked(hub.url, "leaf", WAIT, user="d_watcher", password=passwords["d_watcher"])
        yield Domain(hub, leaf, passwords, [])


async def _until(cond: Any, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_each_role_runs_its_job_in_the_leafs_domain_with_exactly_its_permissions(
    domain: Domain, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome

    from airflow_nats_ordered.triggers.messages import NatsMessageTrigger

    monkeypatch.setenv(
        "AIRFLOW_CONN_NATS_LEAF",
        json.dumps(
            {
                "conn_type": "nats",
                "login": "d_watcher",
                "password": domain.passwords["d_watcher"],
                "extra": {"servers": domain.hub.url, "js_domain": "leaf"},
            }
        ),
    )

    n = 30
    records = [InputRecord(f"k{i % 5}", b"%d" % i, None, "test") for i in range(n)]

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        op = await domain.connect("d_operator")
        await provision(op, StreamSpec(STREAM, partitions=3))
        pub = await domain.connect("d_publisher")
        run = await publish_run(pub, STREAM, records, producer_id="run-1")
        out["run"] = run.record
        await pub.close()
        seen: list[bytes] = []

        async def handler(msg: Any) -> None:
            seen.append(msg.data)

        nc = await domain.connect("d_worker")
        worker = Worker(nc, WorkerConfig(STREAM, GROUP, member_id="w", lease_ttl=2.0), handler)
        await worker.start()
        await _until(lambda: len(seen) >= n, "every record")
        watcher = await domain.connect("d_watcher")
        out["drained"] = await wait_drained(
            watcher, STREAM, GROUP, marks=run.record.high_water_marks, timeout=WAIT
        )
        out["lag"] = await read_lag(watcher, STREAM, GROUP)
        await worker.stop()
        await nc.close()
        await watcher.close()
        await op.close()
        out["seen"] = seen
        # the triggerer's nats:// watcher: its durable on the leaf, pulled and acked
        trigger = NatsMessageTrigger(stream=STREAM, nats_conn_id="nats_leaf", ack_wait=5)
        producer = NatsMessageTrigger.create_shared_stream_producer(
            json.loads(json.dumps(trigger.serialize()[1]))
        )
        try:
            stream = producer.open_stream()
            got: list[Any] = []
            async with asyncio.timeout(WAIT):
                while len(got) < n:
                    got.append(await anext(stream))
            for delivery, _ in got:
                delivery.handed_over()
            await producer.advance(
                [AdvanceItem(m, AdvanceOutcome(acked=1, failed=0)) for _, m in got]
            )
        finally:
            await producer.aclose()
        out["watched"] = [p["stream_seq"] for p, _ in got]
        out["durable"] = await _durable_state()
        return out

    async def _durable_state() -> tuple[int, int]:
        """(acks pending, records not yet delivered) of the watcher's durable, as the
        leaf's own JetStream sees it: the acks arrived across the leaf connection."""
        nc = await nats.connect(domain.leaf.url)
        try:
            js = nc.jetstream()
            async with asyncio.timeout(WAIT):
                while True:
                    consumers = await js.consumers_info(STREAM)
                    durable = [c for c in consumers if c.config.durable_name]
                    if durable and durable[0].num_ack_pending == 0:
                        return durable[0].num_ack_pending, durable[0].num_pending or 0
                    await asyncio.sleep(0.1)
        finally:
            await nc.close()

    out = asyncio.run(go())
    assert domain.violations() == []
    assert out["run"].status == "complete" and out["run"].acked == n
    assert sorted(out["seen"]) == sorted(b"%d" % i for i in range(n))
    assert out["lag"].drained
    assert out["watched"] == list(range(1, n + 1))
    assert out["durable"] == (0, 0)


def test_a_violation_would_be_seen(domain: Domain) -> None:
    """The check above can fail: a worker's publish into the stream is refused by the hub
    and reported to error_cb and in the hub's log."""

    async def go() -> None:
        nc = await domain.connect("d_worker")
        await nc.publish("orders.p.0", b"forged")
        await nc.flush()
        await _until(lambda: len(domain.violations()) >= before + 2, "the refusal", 10)
        await nc.close()

    before = len(domain.violations())
    asyncio.run(go())
    assert len(domain.violations()) - before >= 2, domain.violations()
