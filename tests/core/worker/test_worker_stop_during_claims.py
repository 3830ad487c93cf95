"""A member stopped while its claims are in flight leaves no partition lease behind (issue
19 item 2 review of b1c93f2: a member without on_assign/fencing_floor hooks sends all its
claims at once).

``stop()`` is called (as on SIGTERM) right after a starting member sent its first claims.
A claim cancelled while its lease's create was on the wire left the lease held on the server
although the member had left: no other member could claim that partition for a whole lease
TTL. Claimed one after another that was one partition; claimed at once it was every
partition of the member (16 of 16 here). The member must wait for those answers and give
back what it got: once ``stop()`` returns, the group's lease bucket holds no lease of it.
"""

from __future__ import annotations

import asyncio

import nats
from nats.js.errors import NoKeysError

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

P = 16


def stopped_at_its_first_claim(w: Worker) -> None:
    """Make ``w`` stop itself (a task, as a signal handler would) once its first claim
    began."""
    try_claim = w.reconciler.try_claim
    stopping: list[asyncio.Task[None]] = []

    async def first_claim_stops(p: int) -> None:
        if not stopping:
            stopping.append(asyncio.ensure_future(w.stop()))
        await try_claim(p)

    w.reconciler.try_claim = first_claim_stops  # the reconcile loop's claims call it


def test_a_member_stopped_while_claiming_leaves_no_lease_behind(shared_nats_server, unique_name):
    async def go() -> tuple[list[str], int]:
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=P))
        cfg = WorkerConfig(unique_name, "g", member_id="a", lease_ttl=30.0)
        w = Worker(nc, cfg, lambda m: None)
        stopped_at_its_first_claim(w)
        await w.start()
        async with asyncio.timeout(60):  # a bound on a hang
            await w.stopped.wait()
        kv = await nc.jetstream().key_value(GroupConfig(unique_name, "g").lease_bucket)
        try:
            held = sorted(k for k in await kv.keys() if k.startswith("p."))
        except NoKeysError:
            held = []
        await nc.close()
        return held, len(w.owned)

    held, owned = asyncio.run(go())
    assert owned == 0
    assert held == [], f"leases left held by a member that has left: {held}"
