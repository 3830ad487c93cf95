"""A busy member's commit writes across a server restart and a frozen server (issue 19 item 2
review: commit writes go to the socket as one HPUB written by the project, 9c66397; the
reader's deliveries skip nats-py's per-message path, b1c93f2).

While a synchronous handler works through a backlog, the server is restarted (SIGTERM, same
store) or frozen (SIGSTOP) for longer than the lease TTL, and records are published again
after it. Whatever was on the wire when the connection broke may be lost; nothing else may
be. Checked over everything published and handled: every record handled, per key in order
(a re-delivery only replays what was handled after the last commit), each partition's commit
record ends at the partition's last message (a write lost with the connection is sent again),
and no two grants of a partition handle messages at the same time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import nats
from test_worker import _check_replays

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

P = 4
KEYS = 12


class Handled:
    """A synchronous handler that takes a little time per record, and what it handled:
    per key the values in handling order, per partition (token, start, end) per call."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = defaultdict(list)
        self.calls: dict[int, list[tuple[int, float]]] = defaultdict(list)
        self.last_seq: dict[int, int] = {}
        self.count = 0

    def __call__(self, m) -> None:
        t = time.monotonic()
        time.sleep(0.001)
        d = json.loads(m.data)
        self.seen[m.key].append(d["i"])
        self.calls[m.partition].append((m.fencing_token, t))
        self.last_seq[m.partition] = max(self.last_seq.get(m.partition, 0), m.stream_seq)
        self.count += 1


async def _publish(nc, stream: str, start: int, n: int) -> None:
    async with OrderedPublisher(nc, stream) as pub:
        for g in range(start, start + n):
            await pub.publish(f"k{g % KEYS}", json.dumps({"i": g // KEYS}).encode())


async def _until(cond, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout  # a bound on a hang: a loaded machine is slow
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:.0f}s: {what}")
        await asyncio.sleep(0.05)


async def _committed(nc, stream: str) -> dict[int, int]:
    kv = await nc.jetstream().key_value(GroupConfig(stream, "g").state_bucket)
    return {p: json.loads((await kv.get(f"c.{p}")).value)["seq"] for p in range(P)}


def _check(h: Handled, total: int, committed: dict[int, int]) -> None:
    assert sum(len(set(v)) for v in h.seen.values()) == total, "records not handled"
    for key, values in h.seen.items():
        _check_replays(values, key)
    assert committed == h.last_seq, "a commit record is not at its partition's last message"
    for p, calls in h.calls.items():
        # no two grants at once: once a newer token handled the partition, no older one did
        tokens = [token for token, _ in calls]
        assert tokens == sorted(tokens), f"partition {p}: tokens interleave: {tokens}"


async def _run(url: str, stream: str, outage, **connect) -> tuple[Handled, dict[int, int], Worker]:
    """Publish, handle, ``outage()`` (awaited) while the backlog is handled, publish more;
    ``connect``: more options of ``nats.connect`` (TLS)."""
    h = Handled()
    opts = dict(reconnect_time_wait=0.1, max_reconnect_attempts=-1, connect_timeout=2, **connect)
    nc = await nats.connect(url, **opts)
    await provision(nc, StreamSpec(stream, partitions=P))
    await _publish(nc, stream, 0, 1200)
    w = Worker(nc, WorkerConfig(stream, "g", member_id="m1", lease_ttl=2.0, commit_every=20), h)
    await w.start()
    await _until(lambda: h.count >= 150, "150 records handled before the outage")
    await outage()
    pub = await nats.connect(url, **opts)
    await _publish(pub, stream, 1200, 240)
    await _until(lambda: sum(len(set(v)) for v in h.seen.values()) >= 1440, "every record")
    committed: dict[int, int] = {}

    async def caught_up() -> bool:
        committed.update(await _committed(pub, stream))
        return committed == h.last_seq

    deadline = time.monotonic() + 60
    while not await caught_up() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await w.stop()
    await pub.close()
    await nc.close()
    return h, committed, w


def test_a_server_restart_mid_backlog_loses_no_record_and_no_commit(nats_server, unique_name):
    async def restart() -> None:
        await asyncio.to_thread(nats_server.restart)

    h, committed, w = asyncio.run(_run(nats_server.url, unique_name, restart))
    _check(h, 1440, committed)


def test_a_frozen_server_mid_backlog_loses_no_record_and_no_commit(nats_server, unique_name):
    async def freeze() -> None:
        nats_server.pause()
        try:
            await asyncio.sleep(3.0)  # longer than the lease TTL: every lease lapses locally
        finally:
            nats_server.resume()

    h, committed, w = asyncio.run(_run(nats_server.url, unique_name, freeze))
    _check(h, 1440, committed)
