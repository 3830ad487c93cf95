"""Header blocks written by another client reach the handler as nats-py reads them (issue 19
item 2 review of b1c93f2: deliveries go from the socket to the reader without nats-py's
per-message parsing, and each distinct header name is checked once).

A client speaking the NATS protocol directly (a raw socket here: no client library trims or
checks anything) publishes records whose header blocks carry colons in values, blanks around
names, repeated names, empty values, a line without a colon, a UTF-8 value, tabs, a name with
a non-UTF-8 byte and stray line breaks. The worker's handler must get, for each record, the
same headers as a nats-py subscriber of the partition's subject, and every record once, in
order."""

from __future__ import annotations

import asyncio
import json
import socket

import nats
from test_worker import _until

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

KEY = "kk"
BLOCKS = [
    b"X-Colon: a:b:c\r\n  Spaced-Name  : v \r\nDup: 1\r\nDup: 2\r\nEmpty:\r\nNoColonLine\r\n"
    b"Uni: h\xc3\xa9llo\r\nTab:\tv\t\r\nBad\xffName: x\r\n",
    b"A: x\r\r\n",
    b"B: \n\r\n",
    b"Dup: 3\r\nSpaced-Name: w\r\n",  # names seen before, in another block
]


def test_odd_header_blocks_of_a_foreign_client_reach_the_handler_as_nats_py_reads_them(
    shared_nats_server, unique_name
):
    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        subject = (await describe(nc, unique_name)).subject(partition_for(KEY, 2))
        plain: list = []

        async def keep(m) -> None:
            plain.append(m)

        await nc.subscribe(subject, cb=keep)
        await nc.flush()
        with socket.create_connection(("127.0.0.1", shared_nats_server.port)) as s:
            s.recv(4096)  # INFO
            s.sendall(b'CONNECT {"headers":true,"verbose":false,"protocol":1}\r\n')
            for i, extra in enumerate(BLOCKS):
                block = b"NATS/1.0\r\nNats-Ordered-Key: %s\r\n%s\r\n" % (KEY.encode(), extra)
                data = json.dumps({"i": i}).encode()
                total = len(block) + len(data)
                s.sendall(b"HPUB %s %d %d\r\n" % (subject.encode(), len(block), total))
                s.sendall(block + data + b"\r\n")
            s.sendall(b"PING\r\n")
            while b"PONG" not in s.recv(4096):
                pass
        got: list = []
        w = Worker(nc, WorkerConfig(unique_name, "g", member_id="m"), got.append)
        await w.start()
        await _until(lambda: len(got) >= len(BLOCKS) and len(plain) >= len(BLOCKS))
        await w.stop()
        await nc.close()
        return plain, got, w.stats

    plain, got, stats = asyncio.run(go())
    assert [json.loads(m.data)["i"] for m in got] == list(range(len(BLOCKS)))
    assert [m.headers for m in got] == [m.headers for m in plain]
    assert got[0].headers["X-Colon"] == "a:b:c" and got[0].headers["Dup"] == "2"
    assert stats["rejected"] == 0 and stats["processed"] == len(BLOCKS)
