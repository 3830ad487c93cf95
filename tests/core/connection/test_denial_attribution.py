"""A refusal is attributed to the operation it refused, and only while it holds.

A connection may be shared by several parts of a program (an application's own
subscriptions beside a publisher or a worker): a refused subscription of one part (a tap on
``>``) must not fail another's publishes nor stop a worker whose own operations all pass.
And a refusal belongs to the connection it came on: once the client reconnected to a
server that now grants the permission, its requests pass again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats.errors
import pytest

from airflow_nats_ordered.core.admin.permissions import permissions_for
from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import PermissionDenied, denial_in
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.embedded.servers import NatsServer

S, G = "TAPPED", "G"
PASSWORD = "pw-attribution"


def _user(name: str, publish: list[str] | None = None, subscribe: list[str] | None = None) -> str:
    if publish is None or subscribe is None:
        return f"{{ user: {name}, password: {PASSWORD} }}"
    pub = ", ".join(json.dumps(s) for s in publish)
    sub = ", ".join(json.dumps(s) for s in subscribe)
    return (
        f"{{ user: {name}, password: {PASSWORD}, permissions: {{ "
        f"publish: {{ allow: [{pub}] }}, subscribe: {{ allow: [{sub}] }} }} }}"
    )


def _config(inbox_granted: bool = False) -> str:
    publisher = permissions_for("publisher", S)
    worker = permissions_for("worker", S, G)
    users = [
        _user("admin"),
        _user("pub", list(publisher.publish_allow), list(publisher.subscribe_allow)),
        _user("work", list(worker.publish_allow), list(worker.subscribe_allow)),
        # may publish anything; subscribe to an inbox only once granted
        _user("flip", [">"], ["_INBOX.>"] if inbox_granted else ["nothing.here"]),
    ]
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def _options(server: NatsServer, user: str) -> ConnectionOptions:
    return ConnectionOptions(servers=(server.url,), user=user, password=PASSWORD)


async def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("attribution"), extra_config=_config()) as srv:

        async def main() -> None:
            nc = await connect(_options(srv, "admin"))
            try:
                await provision(nc, StreamSpec(S, partitions=2))
            finally:
                await nc.close()

        asyncio.run(main())
        yield srv


async def _tap(nc) -> None:  # noqa: ANN001 - a nats-py client
    """The application's own subscription to everything, which the role's user may not make:
    the server refuses it (the connection stays up)."""
    before = len(denials.violations(nc))
    await nc.subscribe(">")
    await nc.flush()
    await _until(lambda: len(denials.violations(nc)) > before)
    assert denials.violations(nc)[-1] == denials.Violation("subscribe", ">")


def test_a_refused_subscription_of_another_part_does_not_fail_the_publisher(
    server: NatsServer,
) -> None:
    async def main() -> None:
        nc = await connect(_options(server, "pub"))
        try:
            async with OrderedPublisher(nc, S) as pub:
                await _tap(nc)
                for i in range(6):
                    await pub.publish(f"k{i}", b"x")
            assert pub.denied is None
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_refused_subscription_of_another_part_does_not_stop_the_worker(
    server: NatsServer,
) -> None:
    async def main() -> None:
        nc = await connect(_options(server, "work"))
        admin = await connect(_options(server, "admin"))
        seen: list[str] = []
        cfg = WorkerConfig(S, G, member_id="m-tap", lease_ttl=3.0, stop_timeout=5.0)
        w = Worker(nc, cfg, lambda m: seen.append(m.key))
        try:
            await w.start()
            await _tap(nc)
            await asyncio.sleep(0.2)  # the watcher has been told of the refusal
            async with OrderedPublisher(admin, S) as pub:
                for i in range(4):
                    await pub.publish(f"w{i}", b"x")
            wanted = {f"w{i}" for i in range(4)}
            await _until(lambda: wanted <= set(seen) or w.error is not None)
            assert w.error is None, w.error
        finally:
            await w.stop()
            await nc.close()
            await admin.close()

    asyncio.run(main())


def test_a_reply_inbox_granted_after_a_reconnect_is_used(tmp_path: Path) -> None:
    """Refused its reply inbox, the client's requests fail at once with PermissionDenied;
    once the server grants it and the client reconnected, its requests are answered."""
    with NatsServer(tmp_path, extra_config=_config()) as srv:

        async def main() -> None:
            nc = await connect(_options(srv, "flip"))
            try:
                with pytest.raises(Exception) as info:  # noqa: PT011 - checked below
                    await asyncio.wait_for(jetstream(nc, timeout=5).account_info(), 30)
                assert isinstance(denial_in(info.value), PermissionDenied), info.value
                srv.extra_config = _config(inbox_granted=True)
                await asyncio.to_thread(srv.restart)
                await _until(lambda: nc.stats["reconnects"] >= 1 and nc.is_connected)
                info_ = await asyncio.wait_for(jetstream(nc, timeout=5).account_info(), 30)
                assert info_ is not None
            finally:
                await nc.close()

        asyncio.run(main())


def _lifting_config(granted: bool) -> str:
    users = [
        _user("admin"),
        _user("lifted", ["svc.x"] if granted else ["svc.other"], ["_INBOX.>"]),
    ]
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def test_a_timeout_after_a_lifted_refusal_is_a_timeout(tmp_path: Path) -> None:
    """A request refused its publish fails with PermissionDenied; once a config reload
    granted it, the same request timing out (a responder that does not answer) is a
    timeout, not that earlier refusal again: a worker or task would stop for good."""
    with NatsServer(tmp_path, extra_config=_lifting_config(False)) as srv:

        async def main() -> None:
            admin = await connect(_options(srv, "admin"))
            nc = await connect(_options(srv, "lifted"))
            got: list[bytes] = []

            async def silent(msg) -> None:  # noqa: ANN001 - a responder that never answers
                got.append(msg.data)

            try:
                await admin.subscribe("svc.x", cb=silent)
                await admin.flush()
                with pytest.raises(PermissionDenied):
                    await asyncio.wait_for(nc.request("svc.x", b"", timeout=5), 30)
                srv.extra_config = _lifting_config(True)
                Path(srv.config_path).write_text(srv.render_config())
                assert srv.pid is not None
                os.kill(srv.pid, signal.SIGHUP)

                async def granted() -> None:  # the reload applied: a publish gets through
                    while not got:
                        await nc.publish("svc.x", b"probe")
                        await nc.flush()
                        await asyncio.sleep(0.1)

                await asyncio.wait_for(granted(), 30)
                with pytest.raises(nats.errors.TimeoutError):
                    await asyncio.wait_for(nc.request("svc.x", b"", timeout=0.5), 30)
            finally:
                await nc.close()
                await admin.close()

        asyncio.run(main())


def test_concerns_tells_a_member_s_own_refusals_from_others() -> None:
    """Pure: under a JetStream domain too, a refusal naming the member's stream, its group's
    buckets or dead letters, or its inbox is its own; another stream's, another group's,
    or an application's wildcard subscription is not."""
    from nats.aio.client import Client

    from airflow_nats_ordered.core.connection.api import remember_api_prefix
    from airflow_nats_ordered.core.group.config import GroupConfig

    nc = Client()
    remember_api_prefix(nc, "$JS.leaf.API")
    names = GroupConfig("ORDERS", "G").jetstream_names()
    prefixes = ("orders.dlq.G",)

    def mine(operation: str, subject: str) -> bool:
        error = PermissionDenied(operation, subject)
        return denials.concerns(nc, error, names=names, prefixes=prefixes)

    assert mine("publish", "$JS.leaf.API.CONSUMER.MSG.NEXT.ORDERS.abc")
    assert mine("publish", "$JS.leaf.API.$KV.nor_ORDERS_G_leases.m1")
    assert mine("publish", "$KV.nor_ORDERS_G_state.c.0")
    assert mine("publish", "$JS.leaf.API.STREAM.INFO.KV_nor_ORDERS_G_state")
    assert mine("publish", "orders.dlq.G.3")
    assert mine("subscribe", "_INBOX.abc.*")
    assert not mine("publish", "$JS.leaf.API.STREAM.INFO.OTHER")
    assert not mine("publish", "$KV.nor_ORDERS_H_leases.m1")
    assert not mine("publish", "orders.dlq.H.3")
    assert not mine("publish", "orders.p.0")
    assert not mine("subscribe", ">")
    assert not mine("subscribe", "events.>")
