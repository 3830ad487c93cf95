"""P5: how soon the Airflow drain trigger fires after the last commit it waits for.

One embedded nats-server, a 2-member worker pool (commit_interval 0.2 s) and a 16-partition
stream. Each round publishes BENCH_DRAIN_N records and runs ``NatsGroupDrainTrigger.run()``
(the code the triggerer runs) on the publisher's high-water marks. The latency is from the
moment the server stored the last commit record the trigger needed (its stream timestamp)
to the trigger's event. The baseline, measured in the same round, is the floor any
push-based wait has: a KV put on the same server until a watcher of that key sees it.

Environment: BENCH_DRAIN_ROUNDS (default 5), BENCH_DRAIN_N (default 20000).
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

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher  # noqa: E402
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision  # noqa: E402
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool  # noqa: E402
from airflow_nats_ordered.embedded.servers import NatsServer  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_DRAIN_ROUNDS", "5"))
N = int(os.environ.get("BENCH_DRAIN_N", "20000"))


async def _kv_floor(nc) -> float:
    """Seconds from a KV put to a watcher seeing it (the push floor)."""
    js = nc.jetstream()
    kv = await js.create_key_value(bucket=f"floor_{os.getpid()}_{time.time_ns()}")
    watcher = await kv.watch("k")
    await watcher.updates(timeout=5)  # the initial None marker
    t0 = time.time()
    await kv.put("k", b"x")
    while await watcher.updates(timeout=5) is None:
        pass
    took = time.time() - t0
    await watcher.stop()
    await js.delete_key_value(kv._name)
    return took


async def _last_commit_time(nc, stream: str, partitions: list[int]) -> float:
    """When the server stored the newest of the commit records of ``partitions``."""
    bucket = GroupConfig(stream, "g").state_bucket
    js = nc.jetstream()
    newest = 0.0
    for p in partitions:
        msg = await js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.c.{p}")
        newest = max(newest, msg.time.timestamp() if msg.time else 0.0)
    return newest


async def main() -> None:
    # a throw-away Airflow home unless one is set (the trigger reads its connection there)
    os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="bench-airflow-"))
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    from airflow_nats_ordered.triggers.drain import NatsGroupDrainTrigger

    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as server:
        os.environ["AIRFLOW_CONN_NATS_BENCH"] = json.dumps(
            {"conn_type": "nats", "extra": {"servers": server.url}}
        )
        nc = await nats.connect(server.url)
        stream = "DRAINBENCH"
        await provision(nc, StreamSpec(stream, partitions=16))
        cfg = WorkerConfig(stream, "g", member_id="b", commit_interval=0.2, lease_ttl=5)

        async def handler(msg) -> None:
            pass

        lat, floor = [], []
        async with WorkerPool(server.url, cfg, handler, size=2) as pool:
            await pool.wait_assigned(30)
            for r in range(ROUNDS):
                async with OrderedPublisher(nc, stream, producer_id=f"r{r}") as pub:
                    for i in range(N):
                        await pub.publish(f"k{i % 997}", b'{"n":1}')
                marks = {str(p.partition): p.last_seq for p in pub.summary.partitions}
                trigger = NatsGroupDrainTrigger(
                    stream=stream, group="g", marks=marks, nats_conn_id="nats_bench", timeout=120
                )
                async for event in trigger.run():
                    fired = time.time()
                    assert event.payload["status"] == "success", event.payload
                last = await _last_commit_time(nc, stream, [int(p) for p in marks])
                lat.append(fired - last)
                floor.append(await _kv_floor(nc))
                print(
                    f"  round {r + 1}: trigger fired {lat[-1] * 1000:.0f} ms after the last "
                    f"commit (KV push floor {floor[-1] * 1000:.1f} ms)",
                    flush=True,
                )
        await nc.close()
    med, worst = statistics.median(lat), max(lat)
    print(
        f"P5 drain detection: median {med * 1000:.0f} ms, max {worst * 1000:.0f} ms after the "
        f"last commit ({N} records x {ROUNDS} rounds); KV push floor median "
        f"{statistics.median(floor) * 1000:.1f} ms; ratio median/floor "
        f"{med / max(statistics.median(floor), 1e-6):.1f}x; goal <= 1000 ms: "
        f"{'met' if worst <= 1.0 else 'NOT met'}"
    )


if __name__ == "__main__":
    asyncio.run(main())
