"""Denied operations fail with PermissionDenied naming the subject, against a real server.

One nats-server (shared by the module) with two accounts, A and B, each holding a stream
``ORDERS`` and a group ``G`` of the same names, and users of A with exactly the permission
set of their role (:func:`~airflow_nats_ordered.core.admin.permissions.permissions_for`):
the server refuses what the role lacks, and the client names the refused permission at
once instead of timing out or retrying for ever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
from collections.abc import Iterator

import pytest
from permission_accounts import G, H, S, accounts_config, options, reload

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.denials import covers
from airflow_nats_ordered.core.errors import PermissionDenied, denial_in
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.kv import latest_entry
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.embedded.servers import NatsServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("denials"), extra_config=accounts_config()) as srv:
        yield srv


async def _as(server: NatsServer, user: str):  # noqa: ANN202 - a nats-py client
    return await connect(options(server, user))


@pytest.fixture(scope="module")
def provisioned(server: NatsServer) -> NatsServer:
    """Both accounts provision ORDERS; A has 12 records, B 3 others."""

    async def main() -> None:
        for admin, keys in (
            ("admin_a", [f"a{i}" for i in range(12)]),
            ("admin_b", ["b0", "b1", "b2"]),
        ):
            nc = await _as(server, admin)
            try:
                await provision(nc, StreamSpec(S, partitions=4))
                async with OrderedPublisher(nc, S) as pub:
                    for k in keys:
                        await pub.publish(k, k.encode())
            finally:
                await nc.close()

    asyncio.run(main())
    return server


def _config_of(group: str, member: str) -> WorkerConfig:
    return WorkerConfig(S, group, member_id=member, lease_ttl=3.0, stop_timeout=5.0)


async def _until(cond, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def _consume(server: NatsServer, user: str, count: int) -> list[str]:
    """Run a worker of G as ``user`` until it handled ``count`` records; their keys."""
    nc = await _as(server, user)
    seen: list[str] = []
    w = Worker(nc, _config_of(G, f"m-{user}"), lambda m: seen.append(m.key))
    try:
        await w.start()
        await _until(lambda: len(seen) >= count)
        await asyncio.sleep(0.3)  # nothing more comes
        assert w.error is None
    finally:
        await w.stop()
        await nc.close()
    return seen


def test_each_account_has_its_own_stream_and_group(provisioned: NatsServer) -> None:
    """Same stream and group names in two accounts: A's worker (exactly the worker role)
    sees only A's records, and B's group starts from B's first record, not after A's
    commits: nothing of one account is visible in the other."""
    a = asyncio.run(_consume(provisioned, "worker_a", 12))
    assert sorted(a) == sorted(f"a{i}" for i in range(12))
    b = asyncio.run(_consume(provisioned, "worker_b", 3))
    assert sorted(b) == ["b0", "b1", "b2"]


def _denied(exc: BaseException, operation: str, *parts: str) -> PermissionDenied:
    found = denial_in(exc)
    assert found is not None, f"no PermissionDenied behind {exc!r}"
    assert found.operation == operation, found
    for part in parts:
        assert part in found.subject, (part, found.subject)
    assert found.subject in str(found) and "permission denied" in str(found)
    return found


async def _fails_fast(coro, operation: str, *parts: str) -> PermissionDenied:  # noqa: ANN001
    """``coro`` fails with PermissionDenied naming the subject, well before nats-py's 5 s
    request timeout (the server's refusal is answered, not waited out)."""
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:  # noqa: PT011 - checked below
        await asyncio.wait_for(coro, 30)
    took = time.monotonic() - t0
    found = _denied(info.value, operation, *parts)
    assert took < 4.0, f"failed only after {took:.1f}s: timed out instead of refused"
    return found


def test_worker_cannot_touch_another_groups_state(provisioned: NatsServer) -> None:
    """The worker of G may not join H, read H's commits or write H's leases."""
    other = GroupConfig(S, H)

    async def main() -> None:
        admin = await _as(provisioned, "admin_a")
        nc = await _as(provisioned, "worker_a")
        try:
            w0 = Worker(admin, _config_of(H, "h-admin"), lambda m: None)
            await w0.start()  # H exists, with its state
            await w0.wait_assigned(30)
            await w0.stop()
            w = Worker(nc, _config_of(H, "intruder"), lambda m: None)
            await _fails_fast(w.start(), "publish", f"nor_{S}_{H}_")
            await _fails_fast(
                latest_entry(nc, other.state_bucket, "c.0"), "publish", other.state_bucket
            )
            js = nc.jetstream()
            await _fails_fast(
                js.publish(f"$KV.{other.lease_bucket}.p.0", b"mine"),
                "publish",
                f"$KV.{other.lease_bucket}.p.0",
            )
        finally:
            await nc.close()
            await admin.close()

    asyncio.run(main())


def test_worker_cannot_publish_into_the_stream(provisioned: NatsServer) -> None:
    async def main() -> None:
        nc = await _as(provisioned, "worker_a")
        try:
            pub = OrderedPublisher(nc, S)
            await pub.start()
            await pub.publish("a1", b"forged")
            with pytest.raises(PublishError) as info:
                await asyncio.wait_for(pub.flush(), 4.0)  # refused, not resent until 120 s
            _denied(info.value, "publish", "orders.p.")
            assert pub.denied is not None and pub.failed == 1
            await pub.close(raise_on_failure=False)
        finally:
            await nc.close()

    asyncio.run(main())


def test_worker_cannot_delete_anything(provisioned: NatsServer) -> None:
    cfg = GroupConfig(S, G)

    async def main() -> None:
        nc = await _as(provisioned, "worker_a")
        js = nc.jetstream()
        try:
            await _fails_fast(js.delete_stream(S), "publish", f"STREAM.DELETE.{S}")
            await _fails_fast(js.purge_stream(S), "publish", f"STREAM.PURGE.{S}")
            for bucket in (cfg.lease_bucket, cfg.state_bucket):  # its own group's state
                await _fails_fast(
                    js.delete_key_value(bucket), "publish", f"STREAM.DELETE.KV_{bucket}"
                )
            await _fails_fast(
                js.delete_consumer(f"KV_nor_{S}_runs", "any"),
                "publish",
                f"CONSUMER.DELETE.KV_nor_{S}_runs",
            )
        finally:
            await nc.close()

    asyncio.run(main())


def test_publisher_cannot_touch_group_state(provisioned: NatsServer) -> None:
    cfg = GroupConfig(S, G)

    async def main() -> None:
        nc = await _as(provisioned, "pub_a")
        try:
            w = Worker(nc, _config_of(G, "publisher-as-member"), lambda m: None)
            await _fails_fast(w.start(), "publish", f"nor_{S}_{G}_")
            await _fails_fast(
                nc.jetstream().publish(f"$KV.{cfg.state_bucket}.c.0", b"{}"),
                "publish",
                f"$KV.{cfg.state_bucket}.c.0",
            )
            await _fails_fast(latest_entry(nc, cfg.state_bucket, "c.0"), "publish", "MSG.GET")
        finally:
            await nc.close()

    asyncio.run(main())


def test_global_order_reader_cannot_publish(provisioned: NatsServer) -> None:
    async def main() -> None:
        nc = await _as(provisioned, "reader_a")
        try:
            pub = OrderedPublisher(nc, S)
            await pub.start()
            for i in range(3):
                await pub.publish(f"r{i}", b"forged")
            with pytest.raises(PublishError) as info:
                await asyncio.wait_for(pub.flush(), 4.0)
            _denied(info.value, "publish", "orders.p.")
            await pub.close(raise_on_failure=False)
        finally:
            await nc.close()

    asyncio.run(main())


async def _member_stops_on_revocation(server: NatsServer, pool: bool) -> PermissionDenied:
    """A member running as ``revocable_a`` loses the right to write its leases: it stops
    once with the error naming the lease bucket, instead of retrying for ever."""
    cfg = _config_of(G, "revocable")
    seen: list[str] = []
    if pool:
        members = WorkerPool(options(server, "revocable_a"), cfg, lambda m: seen.append(m.key))
        await members.start()
        w = members.workers[0]
    else:
        nc = await _as(server, "revocable_a")
        w = Worker(nc, cfg, lambda m: seen.append(m.key))
        await w.start()
    try:
        await w.wait_assigned(30)
        reload(server, accounts_config(revoked=True))
        async with asyncio.timeout(30):  # a lease renewal comes every lease_ttl / 3
            await w.stopped.wait()
        assert isinstance(w.error, PermissionDenied), w.error
        return w.error
    finally:
        reload(server, accounts_config())
        if pool:
            await members.stop()
        else:
            await w.stop()
            await nc.close()


def test_running_worker_stops_when_a_permission_is_revoked(provisioned: NatsServer) -> None:
    error = asyncio.run(_member_stops_on_revocation(provisioned, pool=False))
    assert error.operation == "publish"
    assert error.subject.startswith(f"$KV.{GroupConfig(S, G).lease_bucket}.")


def test_pool_member_stops_when_a_permission_is_revoked(provisioned: NatsServer) -> None:
    error = asyncio.run(_member_stops_on_revocation(provisioned, pool=True))
    assert error.subject.startswith(f"$KV.{GroupConfig(S, G).lease_bucket}.")


def test_refused_reply_inbox_is_named(provisioned: NatsServer) -> None:
    """A user without its inbox (``_INBOX.>``) gets every request refused at once, naming
    the inbox to allow; not a timeout per request."""

    async def main() -> None:
        # pub_a may subscribe to _INBOX.> only: a reply inbox elsewhere is refused
        nc = await connect(
            dataclasses.replace(options(provisioned, "pub_a"), inbox_prefix="_MYBOX")
        )
        try:
            found = await _fails_fast(nc.jetstream().stream_info(S), "subscribe", "_MYBOX.")
            assert found.grant == "_MYBOX.>"
            again = await _fails_fast(nc.jetstream().stream_info(S), "subscribe", "_MYBOX.")
            assert again.grant == "_MYBOX.>"
        finally:
            await nc.close()

    asyncio.run(main())


def test_the_error_keeps_its_parts_pickled_and_reworded() -> None:
    """What an interface (or a Spark task's error, pickled to the driver) reads of it."""
    e = PermissionDenied("subscribe", "_INBOX.ab.*", grant="_INBOX.>")
    assert e.permission == "subscribe to _INBOX.ab.* (allow _INBOX.>)"
    worded = e.in_terms("the user given by --creds c.creds (NATS_CREDS)", "run it")
    assert str(worded) == (
        "permission denied: subscribe to _INBOX.ab.* (allow _INBOX.>) for the user given by "
        "--creds c.creds (NATS_CREDS); run it"
    )
    back = pickle.loads(pickle.dumps(worded))
    assert (back.operation, back.subject, back.grant, str(back)) == (
        "subscribe",
        "_INBOX.ab.*",
        "_INBOX.>",
        str(worded),
    )
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = PublishError.__new__(PublishError)
    wrapped.__cause__.__cause__ = e
    assert denial_in(wrapped) is e and denial_in(RuntimeError("x")) is None
    assert covers("_inbox.ab.*", "_inbox.ab.7") and not covers("_inbox.ab.*", "_inbox.ab.7.x")
    assert covers("_inbox.t.>", "_inbox.t.0.x") and not covers("_inbox.t.>", "_inbox.t")
