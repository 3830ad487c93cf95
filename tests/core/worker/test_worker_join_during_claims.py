"""Members joining while the first member's claims run at once (issue 19 item 2 review: a
member without on_assign/fencing_floor hooks claims all its partitions concurrently, and
one that has read no assignment yet looks for one every tick/10, b1c93f2).

Two members start together on a new group with a backlog, a third joins while they work
through it, and the first leaves (gracefully) before the end: each join and leave moves
partitions while claims are in flight. Over everything published and handled: every record
handled, per key in order (a move only replays what was handled after the last commit), no
two grants of a partition handling at once (once a newer token handled it, no older one
does), and each partition's commit record ends at its last message.
"""

from __future__ import annotations

import asyncio

import nats
from test_worker_commit_outages import KEYS, Handled, P, _check, _committed, _publish, _until

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

TOTAL = 1200


def test_members_joining_and_leaving_during_concurrent_claims(shared_nats_server, unique_name):
    h = Handled()

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=P))
        await _publish(nc, unique_name, 0, TOTAL)

        def member(name: str) -> Worker:
            cfg = WorkerConfig(unique_name, "g", member_id=name, lease_ttl=3.0, commit_every=20)
            return Worker(nc, cfg, h)

        a, b, c = member("a"), member("b"), member("c")
        await asyncio.gather(a.start(), b.start())
        await _until(lambda: h.count >= 100, "100 records handled")
        await c.start()
        await _until(lambda: h.count >= 500, "500 records handled")
        await a.stop()
        handled = lambda: sum(len(set(v)) for v in h.seen.values())  # noqa: E731
        await _until(lambda: handled() >= TOTAL, "every record handled")
        committed: dict[int, int] = {}
        for _ in range(600):
            committed = await _committed(nc, unique_name)
            if committed == h.last_seq:
                break
            await asyncio.sleep(0.1)
        await asyncio.gather(b.stop(), c.stop())
        await nc.close()
        return committed

    committed = asyncio.run(go())
    assert len(h.seen) == KEYS
    _check(h, TOTAL, committed)
