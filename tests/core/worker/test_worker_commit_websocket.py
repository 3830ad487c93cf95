"""A commit write over a websocket connection (``ws://``) reaches the server
(core/group/cas_writes.py).

nats-py's websocket transport only queues what it is given until ``drain()``, and nats-py's
flusher drains it only while the client's own buffer holds something. The commit write was
moved from that buffer into the transport's queue and the buffer emptied, so the write stayed
unsent until something else was sent on the connection: a committer on a quiet ``ws://``
connection had its write time out after 5 s without the server ever seeing it (here: not
stored 30 s after it was submitted). Needs the optional ``aiohttp``
(nats-py's websocket transport); skipped without it.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.committer import PartitionCommitter
from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.embedded.servers import NatsServer


def test_a_commit_write_over_a_websocket_reaches_the_server(tmp_path, unique_name):
    pytest.importorskip("aiohttp")
    ws_port = free_port()
    websocket = f'websocket {{\n  listen: "127.0.0.1:{ws_port}"\n  no_tls: true\n}}\n'

    async def go(server: NatsServer):
        nc = await nats.connect(f"ws://127.0.0.1:{ws_port}")
        await provision(nc, StreamSpec(unique_name, partitions=1))
        store = await GroupStore.open(nc, GroupConfig(unique_name, "g", lease_ttl=30.0))
        g = await store.grant(0, "a")
        # the committer only asks whether the lease is still valid locally
        c = PartitionCommitter(store, g, Lease("p.0", "a", 1, time.monotonic() + 300), "a")
        # the server PINGs a new client once about 2 s after it connected, then every 2
        # minutes: the PONG is the only other thing this connection would send (it flushed
        # the queue on the old code), so the write goes after it
        await asyncio.sleep(3)
        await c.submit(40, None, 40)  # nothing else is published on this connection
        # read from another connection, so this one sends nothing that would flush it
        other = await nats.connect(server.url)
        kv = await other.jetstream().key_value(GroupConfig(unique_name, "g").state_bucket)
        deadline = time.monotonic() + 30  # a bound on a hang; the write's answer waits 5 s
        seq = 0
        while seq != 40 and time.monotonic() < deadline:
            seq = json.loads((await kv.get("c.0")).value)["seq"]
            await asyncio.sleep(0.05)
        await c.wait_answered(60)
        answered = c.committed_count
        c.cancel()
        await other.close()
        await nc.close()
        return seq, answered

    with NatsServer(tmp_path / "nats", extra_config=websocket, name="ws-server") as server:
        seq, answered = asyncio.run(go(server))
    assert seq == 40, f"the server held position {seq} while the write was 'on the wire'"
    assert answered == 40
