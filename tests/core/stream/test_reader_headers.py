"""The reader parses header blocks itself (issue 19 item 2): exactly as nats-py does.

The worker's reader takes its inboxes' deliveries off the socket without nats-py's
per-message work, and parses each header block with :func:`parse_headers` when the batch
is built. A key or msg-id must come out byte for byte as nats-py would give it (a key that
differs no longer hashes to its partition), so the parser is checked against nats-py's own
on generated blocks full of edge cases, and end to end on a real server."""

from __future__ import annotations

import asyncio
import random

import nats
from nats.aio.client import Client

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.reader import parse_headers
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

PIECES = [
    b"a",
    b"Z",
    b"-",
    b":",
    b" ",
    b"\t",
    b"\x0b",
    b"\x0c",
    b"\x1c",
    b"\x85",
    b"\xc2\xa0",  # no-break space: not trimmed by nats-py (it trims bytes)
    b"\xe2\x80\x83",  # em space
    b"\xc3\xa9",
    b"\xc3",  # a truncated sequence
    b"\xff",
    b"\r",
    b"\n",
]


def test_parse_headers_is_nats_py_parse_on_generated_blocks():
    rnd = random.Random(19)
    for _ in range(20_000):
        lines = [
            b"".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 8)))
            for _ in range(rnd.randint(0, 4))
        ]
        raw = b"NATS/1.0\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"
        assert parse_headers(raw) == Client._parse_header_lines(raw[10:]), raw


def test_a_handler_gets_the_headers_nats_py_gives_a_subscriber(shared_nats_server, unique_name):
    headers = {
        "Nats-Msg-Id": "id-1",
        "X-Nbsp": "v\u00a0",
        "X-Utf8": "\u00e9t\u00e9 \u2003",
        "X-Colon": "a: b: c",
    }

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        subject = f"{unique_name.lower()}.p.0"
        got_sub: asyncio.Future = asyncio.get_running_loop().create_future()

        async def cb(msg):
            if not got_sub.done():
                got_sub.set_result(dict(msg.headers or {}))

        await nc.subscribe(subject, cb=cb)
        await nc.jetstream().publish(subject, b"x", headers=headers)
        seen: list[dict[str, str]] = []
        w = Worker(
            nc,
            WorkerConfig(unique_name, "g", member_id="m1", lease_ttl=2.0, poison="block"),
            lambda m: seen.append(dict(m.headers)),
        )
        await w.start()
        async with asyncio.timeout(60):
            while not seen:
                await asyncio.sleep(0.02)
        await w.stop()
        via_sub = await asyncio.wait_for(got_sub, 60)
        await nc.close()
        return seen[0], via_sub

    worker_view, sub_view = asyncio.run(go())
    assert worker_view == sub_view
    assert worker_view["X-Colon"] == "a: b: c" and worker_view["X-Utf8"].startswith("\u00e9t\u00e9")
