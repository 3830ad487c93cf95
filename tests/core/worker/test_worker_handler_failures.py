"""What a per-message handler raises, through each way the worker calls it (issue 19 item 2
review: a synchronous handler is called without a coroutine per message once its partition
has applied a message, and what that call raises goes on in the retry path, d65a89b).

One partition, one key, records 0..59. The handler fails record 0 once (before anything was
applied: the retry path's own first call), record 10 twice, record 20 every time, and for
record 30 returns an awaitable that fails once. With ``max_retries=2`` that is exactly 2, 3,
3 and 2 calls; record 20 is dead-lettered and everything else is applied once, in order. The
same schedule runs with a synchronous handler, an async one, and a synchronous one under the
``block`` poison policy, which must stop the partition at record 20 with the commit record
before it (the marker says why) and hand over nothing after it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import nats
import pytest
from test_worker import _publish, _until
from test_worker_guarantees import _dead_letters

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

FAILS = {0: 1, 10: 2, 20: 10**6}  # record -> how many of its calls raise
AWAITED_FAILS = {30: 1}  # record -> how many awaitables returned for it raise


class Schedule:
    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()
        self.applied: list[int] = []

    def step(self, m) -> int | None:
        """The record's value; raises as scheduled; None: an awaitable must fail."""
        i = json.loads(m.data)["i"]
        self.calls[i] += 1
        if self.calls[i] <= FAILS.get(i, 0):
            raise ValueError(f"record {i} failed")
        if self.calls[i] <= AWAITED_FAILS.get(i, 0):
            return None
        self.applied.append(i)
        return i


async def _fail_later(i: int) -> None:
    await asyncio.sleep(0)
    raise ValueError(f"record {i} failed in its awaitable")


def _handler(kind: str, s: Schedule):
    if kind == "async":

        async def handle(m) -> None:
            await asyncio.sleep(0)
            if s.step(m) is None:
                await _fail_later(json.loads(m.data)["i"])

        return handle

    def handle_sync(m):
        if s.step(m) is None:
            return _fail_later(json.loads(m.data)["i"])
        return None

    return handle_sync


@pytest.mark.parametrize("kind", ["sync", "async", "sync-block"])
def test_failures_are_retried_counted_and_dead_lettered_alike(
    shared_nats_server, unique_name, kind
):
    s = Schedule()
    block = kind == "sync-block"

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        await _publish(nc, unique_name, 0, 60, keys=1)
        cfg = WorkerConfig(
            unique_name,
            "g",
            member_id="m1",
            lease_ttl=5.0,
            max_retries=2,
            retry_backoff=0.01,
            poison="block" if block else "dead-letter",
        )
        w = Worker(nc, cfg, _handler(kind.removesuffix("-block"), s))
        await w.start()
        kv = await nc.jetstream().key_value(GroupConfig(unique_name, "g").state_bucket)
        if block:
            await _until(lambda: w.owned.get(0) is not None and w.owned[0].blocked is not None)
            await _until(lambda: s.calls[20] >= 3)
            await w.stop()
            record = json.loads((await kv.get("c.0")).value)
            marker = (await kv.get("blocked.0")).value.decode()
            await nc.close()
            return w.stats, record, marker, []
        await _until(lambda: len(s.applied) >= 59)
        dead = await _dead_letters(nc, unique_name, 1)
        await _until(lambda: w.owned[0].committer.committed_count >= 59)
        await w.stop()
        record = json.loads((await kv.get("c.0")).value)
        await nc.close()
        return w.stats, record, None, dead

    stats, record, marker, dead = asyncio.run(go())
    if block:
        assert s.applied == list(range(20)), s.applied
        assert s.calls[20] == 3 and 21 not in s.calls, s.calls
        assert record["seq"] == 20, record  # stream seq 20 holds record 19
        assert "blocked at seq 21 after 3 attempts" in marker, marker
        return
    assert s.applied == [i for i in range(60) if i != 20], s.applied
    assert [s.calls[i] for i in (0, 10, 20, 30)] == [2, 3, 3, 2], s.calls
    assert all(s.calls[i] == 1 for i in range(60) if i not in (0, 10, 20, 30)), s.calls
    assert [json.loads(d.data)["i"] for d in dead] == [20]
    assert stats["handler_errors"] == 1 + 2 + 3 + 1, stats
    assert stats["retries"] == 1 + 2 + 2 + 1, stats
    assert stats["processed"] == 59 and stats["dead_lettered"] == 1, stats
    assert record["seq"] == 60, record
