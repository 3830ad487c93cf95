"""An owner fenced while a synchronous handler call is in flight commits nothing after it
(issue 19 item 2 review: d65a89b calls a synchronous handler without a coroutine; 9c66397
writes the commit itself).

The handler, at record 10 of one partition, has an operator reset the group to seq 4 from
another connection (a new fencing token; the lease is taken away) and only then returns.
The member's lease has not expired locally, so its commit write goes out: the server must
refuse it, and the member must stop that grant without committing anything more. Every
write to the partition's commit record after the reset carries a newer token than the
fenced grant's, and records 4.. are handled again, in order, by the next grant.
"""

from __future__ import annotations

import asyncio
import json
import threading

import nats
from test_worker import _publish, _until

from airflow_nats_ordered.core.admin.reset import reset_group
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker


def test_an_owner_fenced_during_a_handler_call_commits_nothing_after_it(
    shared_nats_server, unique_name
):
    seen: list[tuple[int, int]] = []  # (record, token)
    reset_done = threading.Event()

    def reset_now() -> None:
        async def reset() -> None:
            nc = await nats.connect(shared_nats_server.url)
            await reset_group(nc, unique_name, "g", to={0: 4}, confirm=True)
            await nc.close()

        asyncio.run(reset())  # (in a thread: the member's event loop is held by the handler)

    def handle(m) -> None:
        i = json.loads(m.data)["i"]
        seen.append((i, m.fencing_token))
        if i == 10 and not reset_done.is_set():
            t = threading.Thread(target=reset_now)
            t.start()
            t.join(60)
            reset_done.set()

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        await _publish(nc, unique_name, 0, 30, 1)
        cfg = WorkerConfig(unique_name, "g", member_id="m", lease_ttl=30.0, commit_every=1)
        w = Worker(nc, cfg, handle)
        await w.start()  # (creates the group's buckets; the watch replays their history)
        kv = await nc.jetstream().key_value(GroupConfig(unique_name, "g").state_bucket)
        history: list = []

        async def watch() -> None:
            w = await kv.watch("c.0", include_history=True)
            async for e in w:
                if e is not None and e.value:
                    history.append(json.loads(e.value))

        watching = asyncio.ensure_future(watch())
        await _until(lambda: reset_done.is_set() and sum(i == 29 for i, _ in seen) >= 1)
        await _until(lambda: history and history[-1]["seq"] == 30)
        await w.stop()
        watching.cancel()
        await nc.close()
        return history, w.stats

    history, stats = asyncio.run(go())
    fenced = next(t for i, t in seen if i == 10)
    at_reset = next(n for n, h in enumerate(history) if h["member"] == "reset")
    assert history[at_reset]["seq"] == 4
    later = history[at_reset + 1 :]
    assert later and all(h["token"] > fenced for h in later), later
    after = [i for i, t in seen if t > fenced]
    assert after == list(range(4, 30)), after
    assert [i for i, t in seen if t == fenced] == list(range(11)), seen
    assert stats["fenced"] == 1, stats
