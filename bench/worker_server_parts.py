"""Where the worker's nats-server CPU per record goes (issue 33, goal 1): one embedded
nats-server, one backlog, then in one process, rounds alternating, the server CPU (and the
client's) per record of

* ``raw-ordered``: nats-py's ordered consumer (bench/worker_throughput.py's);
* ``readers``: 16 bare :class:`PartitionReader` loops on one connection (the worker's pull
  consumers and requests, nothing else: no group, leases, commits or handler);
* ``worker``: the worker (its default settings);
* ``startup``: the worker on 100 records per partition (its fixed cost: buckets, leases,
  consumers), printed per record of a full run.

    python bench/worker_server_parts.py [--n 200000] [--rounds 3]

Not part of ``make bench``."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import worker_common  # noqa: E402
import worker_throughput as wt  # noqa: E402
from worker_common import BACKLOG_STREAM, PARTITIONS, connect, publish_backlog  # noqa: E402

from airflow_nats_ordered.core.stream.partitioning import partition_subject  # noqa: E402
from airflow_nats_ordered.core.stream.reader import PartitionReader  # noqa: E402
from airflow_nats_ordered.embedded.servers import NatsServer  # noqa: E402


async def readers(url: str, prefix: str, n: int) -> tuple[float, float]:
    """Client and server CPU seconds of 16 readers reading the whole backlog."""
    nc = await connect(url)
    rs = [
        PartitionReader(nc, BACKLOG_STREAM, partition_subject(prefix, p), 1, 500, lambda: 4 << 20)
        for p in range(PARTITIONS)
    ]
    total = [0]

    async def one(r: PartitionReader) -> None:
        while total[0] < n:  # partitions hold unequal shares: read until all are in
            got = len(await r.fetch(timeout=0.2))
            total[0] += got

    c0 = wt._cpu()
    await asyncio.gather(*(one(r) for r in rs))
    c1 = wt._cpu()
    for r in rs:
        await r.close()
    await nc.close()
    return c1[0] - c0[0], c1[1] - c0[1]


async def main(n: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="wsp-") as tmp, NatsServer(Path(tmp) / "n") as srv:
        worker_common.SERVER_PID = srv.pid
        nc = await connect(srv.url)
        prefix = await publish_backlog(nc, BACKLOG_STREAM, n)
        await nc.close()
        res: dict[str, list[tuple[float, float]]] = {}
        small = 100 * PARTITIONS
        for rnd in range(rounds):
            names = ["raw-ordered", "readers", "worker", "startup"]
            if rnd % 2:
                names.reverse()
            for name in names:
                await asyncio.sleep(0.5)
                wt.WINDOW.clear()
                if name == "readers":
                    c, s = await readers(srv.url, prefix, n)
                    k = n
                elif name == "raw-ordered":
                    run = await wt.v_raw_ordered(srv.url, prefix, n, rnd)
                    c, s, k = wt.WINDOW["client"], wt.WINDOW["server"], run.count
                elif name == "worker":
                    run = await wt.v_worker(srv.url, prefix, n, rnd)
                    c, s, k = wt.WINDOW["client"], wt.WINDOW["server"], run.count
                else:
                    run = await wt.v_worker(srv.url, prefix, small, 50 + rnd)
                    c, s, k = wt.WINDOW["client"], wt.WINDOW["server"], n  # fixed cost / n
                res.setdefault(name, []).append((c * 1e6 / k, s * 1e6 / k))
                print(
                    f"round {rnd + 1} {name:12s} {c * 1e6 / k:6.2f} + {s * 1e6 / k:5.2f} us "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        print(f"\nmedians of {rounds} rounds, N={n:,}")
        for name, xs in res.items():
            c = statistics.median(x[0] for x in xs)
            s = statistics.median(x[1] for x in xs)
            print(f"{name:12s} client {c:6.2f}  server {s:5.2f} us per record")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.rounds))
