"""Issue 18: the global-order reader against the per-partition worker, in the same run.

One embedded nats-server (file storage), an 8-partition stream holding BENCH_GLOBAL_N
records of 100 bytes published with ``global_order=True``. Each round reads all of them
twice from the start with a no-op handler: once with one in-process ``Worker`` (one member
owning every partition, per-key order only) and once with ``GlobalOrderReader`` (one total
order). Printed: records/s of each and merged ÷ per-partition.

Then the time-window mode's added latency: BENCH_GLOBAL_LIVE records published live at about
500/s with a plain JetStream client (a foreign producer) and read by a ``order_by="time"``
reader (lateness BENCH_GLOBAL_LATENESS s), and as many published with ``global_order=True``
and read by the exact (sequence) reader; the latency of a record is handler time minus the
publish time carried in its payload (one host, one clock). Printed: median and p99 of each
and the difference of the medians (what the window adds).

Environment: BENCH_GLOBAL_N (default 50000), BENCH_GLOBAL_ROUNDS (default 3),
BENCH_GLOBAL_LIVE (default 1000), BENCH_GLOBAL_LATENESS (default 0.5).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from airflow_nats_ordered.core.order.reader import GlobalOrderReader  # noqa: E402
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher  # noqa: E402
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision  # noqa: E402
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.embedded.servers import NatsServer  # noqa: E402

N = int(os.environ.get("BENCH_GLOBAL_N", "50000"))
ROUNDS = int(os.environ.get("BENCH_GLOBAL_ROUNDS", "3"))
LIVE = int(os.environ.get("BENCH_GLOBAL_LIVE", "1000"))
LATENESS = float(os.environ.get("BENCH_GLOBAL_LATENESS", "0.5"))
PARTITIONS = 8


async def _until(cond: Any, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark stalled")
        await asyncio.sleep(0.005)


async def _worker_rate(nc: Any, stream: str, group: str) -> float:
    count = [0]

    def handle(msg: Any) -> None:
        count[0] += 1

    cfg = WorkerConfig(stream, group, member_id=f"w-{group}", commit_interval=1.0)
    worker = Worker(nc, cfg, handle)
    t0 = time.perf_counter()
    await worker.start()
    await _until(lambda: count[0] >= N)
    took = time.perf_counter() - t0
    await worker.stop()
    return N / took


async def _global_rate(nc: Any, stream: str, group: str) -> float:
    count = [0]

    def handle(msg: Any) -> None:
        count[0] += 1

    reader = GlobalOrderReader(nc, stream, group, handle, member_id=f"g-{group}")
    t0 = time.perf_counter()
    await reader.start()
    await _until(lambda: count[0] >= N)
    took = time.perf_counter() - t0
    await reader.stop()
    return N / took


async def _live_latency(nc: Any, stream: str, window: bool) -> list[float]:
    """Seconds from publish to handler for LIVE records published at ~500/s."""
    lat: list[float] = []

    def handle(msg: Any) -> None:
        lat.append(time.time() - json.loads(msg.data)["t"])

    kw: dict[str, Any] = {"order_by": "time", "lateness": LATENESS} if window else {}
    reader = GlobalOrderReader(nc, stream, "live", handle, commit_interval=0.5, **kw)
    await reader.start()
    s = await describe(nc, stream)
    js = nc.jetstream()
    pub = None
    if not window:
        pub = OrderedPublisher(nc, stream, global_order=GlobalOrder())
        await pub.start()
    for i in range(LIVE):
        body = json.dumps({"t": time.time(), "pad": "x" * 60}).encode()
        if pub is None:
            await js.publish(s.subject(i % PARTITIONS), body)
        else:
            await pub.publish(f"k{i}", body)
            await pub.flush()
        await asyncio.sleep(0.002)
    if pub is not None:
        await pub.close()
    await _until(lambda: len(lat) >= LIVE)
    await reader.stop()
    return lat


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        stream = "GBENCH"
        await provision(nc, StreamSpec(stream, partitions=PARTITIONS))
        async with OrderedPublisher(nc, stream, global_order=GlobalOrder()) as pub:
            for i in range(N):
                await pub.publish(f"k{i % 1000}", b"x" * 100)
        print(f"global_bench: {N:,} records, {PARTITIONS} partitions, {ROUNDS} rounds")
        ratios = []
        for r in range(ROUNDS):
            w = await _worker_rate(nc, stream, f"w{r}")
            g = await _global_rate(nc, stream, f"g{r}")
            ratios.append(g / w)
            print(f"round {r + 1}: worker {w:,.0f}/s, global reader {g:,.0f}/s, ratio {g / w:.2f}")
        print(f"merged / per-partition: median {statistics.median(ratios):.2f}")
        medians: dict[str, float] = {}
        for name, window in (("sequence", False), ("time", True)):
            live = f"{stream}_{name.upper()}"
            await provision(nc, StreamSpec(live, partitions=PARTITIONS))
            lat = await _live_latency(nc, live, window)
            medians[name] = statistics.median(lat)
            p99 = _p(lat, 0.99) * 1000
            print(f"{name} mode latency: median {medians[name] * 1000:.1f} ms, p99 {p99:.1f} ms")
        added = (medians["time"] - medians["sequence"]) * 1000
        print(f"window mode (lateness {LATENESS:g}s) adds {added:.1f} ms at the median")
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
