"""The reader's parse path alone (issue 33): 300k JetStream deliveries as the worker's
backlog sends them (100 B payloads, msg-id, key, seq and producer headers, v1 ACK reply
subjects) fed in 32 KiB reads (each read's deliveries taken off the reader's buffer after it, as
``fetch`` would) to a connection's protocol parser with a
:class:`PartitionReader` routed on the inbox, as on the socket; process time per frame
from the bytes to the reader's buffer (``cut``), and then per delivery for its header
block (``headers``, what the worker's batch building triggers). Best of ``--repeat``.

    PYTHONPATH=TREE python bench/read_frames_micro.py [--n 300000] [--repeat 5]

Run it with each tree's PYTHONPATH (and ``NATS_ORDERED_NO_EXTENSIONS=1`` for the pure
twin) in the same minutes: the figures are only comparable within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from nats.aio.client import Client

from airflow_nats_ordered.core.stream import reader as reader_mod
from airflow_nats_ordered.core.stream.reader import PartitionReader, _route

INBOX = b"_INBOX.AbCdEfGhIjKlMnOpQrStUv.1"
SID = 7


def _stream(n: int) -> bytes:
    out = []
    payload = b"x" * 100
    for i in range(1, n + 1):
        hdr = (
            b"NATS/1.0\r\nNats-Msg-Id: prod-1:%d\r\nNats-Ordered-Key: key-%d\r\n"
            b"Nats-Ordered-Seq: %d\r\nNats-Ordered-Producer: prod-1\r\n\r\n" % (i, i % 1000, i)
        )
        reply = b"$JS.ACK.BENCH.c%d.1.%d.%d.1764300000000000000.%d" % (SID, i, i, n - i)
        out.append(
            b"HMSG %s %d %s %d %d\r\n%s%s\r\n"
            % (INBOX, SID, reply, len(hdr), len(hdr) + len(payload), hdr, payload)
        )
    return b"".join(out)


async def _once(stream: bytes, read: int) -> tuple[float, float, int]:
    nc = Client()
    routes = _route(nc)
    assert routes is not None
    r = PartitionReader(nc, "BENCH", "bench.p.0", 1, 10**9, lambda: 1 << 40)
    routes[SID] = (r, r._on_data)
    parse = nc._ps.parse
    reads = [stream[i : i + read] for i in range(0, len(stream), read)]
    clock = time.process_time
    cut = hdr = 0.0
    count = 0
    buf = r._buf
    for chunk in reads:
        t0 = clock()
        await parse(chunk)
        t1 = clock()
        # the worker takes them (as fetch does) and builds its batch: the header blocks
        msgs = [m for _, m, _ in buf]
        buf.clear()
        r._buf_bytes = 0
        t2 = clock()
        for m in msgs:
            _ = m.headers
        hdr += clock() - t2
        cut += t1 - t0
        count += len(msgs)
    assert not r._lost and count == r._cseq, (r._lost, count)
    return cut, hdr, count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300_000)
    ap.add_argument("--read", type=int, default=32 * 1024)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    stream = _stream(a.n)
    cut, hdr = [], []
    for _ in range(a.repeat):
        c, h, count = asyncio.run(_once(stream, a.read))
        assert count == a.n
        cut.append(c * 1e6 / count)
        hdr.append(h * 1e6 / count)
    frames = getattr(reader_mod, "frames", None)
    print(
        json.dumps(
            {
                "tree": os.environ.get("PYTHONPATH", ""),
                "compiled": bool(getattr(frames, "COMPILED", False)),
                "cut_us": round(min(cut), 3),
                "headers_us": round(min(hdr), 3),
                "cut_all": [round(x, 3) for x in cut],
            }
        )
    )


if __name__ == "__main__":
    main()
