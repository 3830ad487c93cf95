"""P2 (`make bench`): rows/s of the Spark ``nats-ordered`` sink against the core publisher
on the same rows, in the same run.

Both publish the same N rows (keys over 5,000 aircraft-like keys, an increasing ``ts``,
~100-byte JSON payloads, identical bytes) into fresh 16-partition streams of one embedded
nats-server, as a named run recorded in the ledger:

  core   ``publish_run`` (what the CLI and NatsPublishOperator do), rows already in memory
         and in order
  spark  ``write_ordered`` on a cached DataFrame in ``local[2]``: routing with the one
         partition function (Arrow UDF), shuffle, sort, Arrow writer, ledger commit

Session start (JVM, SparkContext) and one warm-up write (Python workers) are measured and
reported separately; the figure is steady state. Variants alternate for BENCH_ROUNDS rounds,
each ratio is spark / core of the same round (shared machines drift). Goal: >= 0.5x.

Environment: BENCH_SPARK_N (rows, default 200000), BENCH_ROUNDS (default 3).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nats

from airflow_nats_ordered.core.runs import publish_run
from airflow_nats_ordered.core.streams import StreamSpec, provision
from airflow_nats_ordered.embedded import NatsServer

PARTITIONS = 16
N = int(os.environ.get("BENCH_SPARK_N", "200000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


@dataclass(frozen=True, slots=True)
class Row:
    key: str
    payload: bytes
    msg_id: None = None
    where: str = ""


def make_rows(n: int) -> list[dict]:
    return [{"k": f"N{(i * 7919) % 5000:05d}", "ts": i, "pad": "x" * 60} for i in range(n)]


def as_records(rows: list[dict]) -> list[Row]:
    # the sink's payload for these columns: compact JSON in column order
    return [Row(r["k"], json.dumps(r, separators=(",", ":")).encode()) for r in rows]


async def _stream(url: str, name: str) -> None:
    nc = await nats.connect(url)
    try:
        await provision(nc, StreamSpec(name, partitions=PARTITIONS))
    finally:
        await nc.close()


async def _count(url: str, name: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(name)).state.messages
    finally:
        await nc.close()


def run_core(url: str, name: str, records: list[Row]) -> float:
    async def go() -> float:
        await _stream(url, name)
        nc = await nats.connect(url, pending_size=8 * 1024 * 1024)
        try:
            t = time.perf_counter()
            res = await publish_run(nc, name, records, producer_id=f"bench-{name}")
            elapsed = time.perf_counter() - t
            assert res.record.status == "complete" and res.record.acked == len(records)
            return elapsed
        finally:
            await nc.close()

    return asyncio.run(go())


def run_spark(url: str, name: str, df, n: int) -> float:
    from airflow_nats_ordered.spark import write_ordered

    asyncio.run(_stream(url, name))
    t = time.perf_counter()
    rec = write_ordered(
        df,
        stream=name,
        key="k",
        order_by="ts",
        producer_id=f"bench-{name}",
        connection={"url": url},
    )
    elapsed = time.perf_counter() - t
    assert rec.status == "complete" and rec.acked == n, rec.to_dict()
    return elapsed


def main() -> int:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    rows = make_rows(N)
    records = as_records(rows)
    rates: dict[str, list[float]] = {"core": [], "spark": []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="spark-bench-") as tmp, NatsServer(Path(tmp)) as srv:
        t = time.perf_counter()
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.speculation", "false")
            .config("spark.sql.shuffle.partitions", str(PARTITIONS))
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        session_start = time.perf_counter() - t
        df = spark.createDataFrame(rows, "k string, ts long, pad string").cache()
        df.count()
        t = time.perf_counter()
        run_spark(srv.url, "WARMUP", df.limit(1000), 1000)
        warmup = time.perf_counter() - t
        print(
            f"{N:,} rows, {PARTITIONS} partitions, local[2]; session start {session_start:.1f}s, "
            f"warm-up write {warmup:.1f}s (excluded)",
            file=sys.stderr,
        )
        for rnd in range(ROUNDS):
            core = N / run_core(srv.url, f"CORE{rnd}", records)
            sparky = N / run_spark(srv.url, f"SPARK{rnd}", df, N)
            for name in ("CORE", "SPARK"):
                stored = asyncio.run(_count(srv.url, f"{name}{rnd}"))
                assert stored == N, f"{name}{rnd}: {stored} stored of {N}"
            rates["core"].append(core)
            rates["spark"].append(sparky)
            ratios.append(sparky / core)
            print(
                f"  round {rnd + 1}: core {core:,.0f} rows/s, spark {sparky:,.0f} rows/s, "
                f"ratio {sparky / core:.2f}",
                file=sys.stderr,
            )
        spark.stop()
    ratio = statistics.median(ratios)
    print(
        f"\nP2 spark sink {statistics.median(rates['spark']):,.0f} rows/s vs core publisher "
        f"{statistics.median(rates['core']):,.0f} rows/s: {ratio:.2f}x "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}; goal >= 0.5x); session start "
        f"{session_start:.1f}s, warm-up {warmup:.1f}s"
    )
    out = Path(".bench")
    out.mkdir(exist_ok=True)
    (out / "spark.json").write_text(
        json.dumps(
            {
                "n": N,
                "rounds": ROUNDS,
                "rates": rates,
                "ratios": ratios,
                "session_start_s": session_start,
                "warmup_s": warmup,
            },
            indent=2,
        )
    )
    return 0 if ratio >= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
