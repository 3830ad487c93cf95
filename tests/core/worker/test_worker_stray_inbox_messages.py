"""A message on a reader's inbox that is not a JetStream delivery is dropped; the member
goes on (issue 19 item 2 review of b1c93f2: deliveries go from the socket to the reader
without a coroutine, inside nats-py's task reading the socket).

Another client publishes to the worker's reader inboxes (found on the server's /connz, as an
operator's tool or a misdirected reply would) messages whose reply subject is not a
JetStream ACK subject, with and without headers. Reading that reply raised in the task
reading the socket, and nats-py's read loop ends on any such error without reconnecting:
the member read nothing more, no answers either (leases, commits), and records published
afterwards were never handled. They must be.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import nats
from test_worker import Recorder, _publish, _until

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

READER_INBOX = re.compile(r"_INBOX\.[A-Za-z0-9]+")  # (no wildcard: not a request mux)


def _reader_inboxes(monitor_url: str, name: str) -> list[str]:
    with urllib.request.urlopen(f"{monitor_url}/connz?subs=1", timeout=10) as r:
        conns = json.load(r)["connections"]
    subs = [s for c in conns if c.get("name") == name for s in c.get("subscriptions_list", [])]
    return [s for s in subs if READER_INBOX.fullmatch(s)]


def test_stray_messages_on_a_reader_inbox_do_not_stop_the_member(shared_nats_server, unique_name):
    rec = Recorder()

    async def go():
        nc = await nats.connect(shared_nats_server.url, name=unique_name)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await _publish(nc, unique_name, 0, 10, 2)
        w = Worker(nc, WorkerConfig(unique_name, "g", member_id="m"), rec)
        await w.start()
        await _until(lambda: rec.count >= 10)
        url = shared_nats_server.monitor_url
        inboxes = await asyncio.to_thread(_reader_inboxes, url, unique_name)
        other = await nats.connect(shared_nats_server.url)
        for inbox in inboxes:
            await other.publish(inbox, b"stray", reply="not.a.delivery")
            await other.publish(inbox, b"stray", reply="a.b.c.d.e.f.g.h.i", headers={"X": "1"})
        await other.flush()
        await _publish(other, unique_name, 10, 10, 2)
        await _until(lambda: rec.count >= 20)
        await w.stop()
        await other.close()
        await nc.close()
        return inboxes

    inboxes = asyncio.run(go())
    assert len(inboxes) == 2, inboxes  # one reader per partition
    assert rec.seen == {"k0": list(range(10)), "k1": list(range(10))}
