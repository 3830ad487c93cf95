"""What a synchronous handler sees of ``delivering`` on the worker's fast path (issue 33: the
stretches of messages handled without an await set it per message and reset it once).

One partition, 240 records, ``commit_every`` 50 and ``fetch_batch`` 40 (so all but the first
batch go through the fast path, in several stretches and commit points). In
every call the mapping names exactly the message handed over, with its Nats-Msg-Id; a task
the handler starts keeps its own message's mapping; the message that fails once is retried
under it, and an awaitable returned for another is awaited under it; outside the calls (the
``on_revoke`` hook) nothing is being delivered; everything is applied once, in order, and
committed.
"""

from __future__ import annotations

import asyncio
import json

import nats
from test_worker import _publish, _until

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.continuity import delivered_id, delivering
from airflow_nats_ordered.core.stream.message import HDR_MSG_ID
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

N = 240


def test_a_sync_handler_is_called_under_its_message_only(shared_nats_server, unique_name):
    applied: list[int] = []
    wrong: list[tuple[int, object]] = []
    in_tasks: dict[int, str | None] = {}
    outside: list[object] = []
    failed_once: set[int] = set()

    def check(m) -> None:
        current = delivering.get()
        expected = {(m.partition, m.stream_seq): m.headers[HDR_MSG_ID]}
        if dict(current or {}) != expected:
            wrong.append((m.stream_seq, current))

    async def later(m) -> None:
        await asyncio.sleep(0)
        check(m)
        applied.append(json.loads(m.data)["i"])

    def handler(m):
        check(m)
        i = json.loads(m.data)["i"]
        if i == 70 and i not in failed_once:
            failed_once.add(i)
            raise ValueError("once")
        if i == 120:
            return later(m)
        if i % 60 == 30:

            async def record(seq: int = m.stream_seq) -> None:
                await asyncio.sleep(0.01)  # after the handler went on to later messages
                in_tasks[seq] = delivered_id(m.partition, seq)

            asyncio.get_running_loop().create_task(record())
        applied.append(i)
        return None

    def on_revoke(p: int) -> None:
        outside.append(delivering.get())

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        await _publish(nc, unique_name, 0, N, keys=1)
        cfg = WorkerConfig(
            unique_name, "g", member_id="m1", commit_every=50, fetch_batch=40, retry_backoff=0.01
        )
        w = Worker(nc, cfg, handler, on_revoke=on_revoke)
        await w.start()
        await _until(lambda: len(applied) >= N and len(in_tasks) >= N // 60)
        await _until(lambda: w.owned[0].committer.committed_count >= N)
        await w.stop()
        kv = await nc.jetstream().key_value(GroupConfig(unique_name, "g").state_bucket)
        record = json.loads((await kv.get("c.0")).value)
        await nc.close()
        return w.stats, record

    stats, record = asyncio.run(go())
    assert applied == list(range(N)), applied
    assert wrong == [], wrong[:5]
    assert all(v for v in in_tasks.values()) and len(in_tasks) == N // 60, in_tasks
    assert outside == [None], outside
    assert stats["processed"] == N and stats["retries"] == 1, stats
    assert record["seq"] == N, record
