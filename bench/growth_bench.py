"""`make bench-growth`: how cost grows with members, partitions and input size (issue 19 item 5).

Everything runs against one embedded nats-server (file storage) on this machine; figures
are ratios to a baseline measured in the same run, because absolute rates on a shared
machine drift by 2x.

a. Group throughput (``--sections group``): for each partition count P in BENCH_GROWTH_P
   (16, 64, 256) a stream gets a backlog of BENCH_GROWTH_N 100-byte records (5,000 keys,
   published once with the OrderedPublisher); then for each member count M in
   BENCH_GROWTH_M (1, 2, 4), M worker PROCESSES (one ``Worker`` each, defaults, no-op
   handler, a fresh group per run) are started at once and drain the backlog. Time: from
   the first member's ``Worker.start()`` (after its interpreter start-up and connect) until
   every partition's last record was handled by some member, so joining, assignment and
   rebalancing are part of it. Each figure is a ratio to the 1-member / 16-partition run
   of the same round; configurations are rotated over BENCH_GROWTH_ROUNDS rounds, medians.
   Also reported: "settle", the time until every partition was claimed with every member
   holding some (consumers created, leases taken, the assignment stable), and the rate
   after it ("steady"), which is the per-record cost without the set-up; and
   re-deliveries (records handled more than once, after a partition moved while members
   joined).
b. Publisher size (``--sections publisher``): a child process publishes n records (100 B,
   5,000 keys, generated on the fly, so the input holds nothing) for each n in
   BENCH_GROWTH_PUB_N (1M and 10M; 10M takes ~2-4 minutes and ~5 GB of stream storage),
   and reports its peak RSS (VmHWM) and its time; the baseline is the same child with 1,000
   records (interpreter, imports, connection, publisher): RSS above it, and time per record
   as a ratio to the smallest n.

Writes ``.bench/growth.json``. ``python bench/growth_bench.py --sections group`` (about
2-4 minutes with the defaults) or ``--sections publisher``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.embedded.servers import NatsServer

PAYLOAD = 100
KEYS = 5000
env = os.environ.get
N = int(env("BENCH_GROWTH_N", "60000"))
PARTS = [int(x) for x in env("BENCH_GROWTH_P", "16,64,256").split(",")]
MEMBERS = [int(x) for x in env("BENCH_GROWTH_M", "1,2,4").split(",")]
ROUNDS = int(env("BENCH_GROWTH_ROUNDS", "2"))
PUB_N = [int(x) for x in env("BENCH_GROWTH_PUB_N", "1000000,10000000").split(",")]
STALL = float(env("BENCH_STALL", "30"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss_kib() -> int:
    """This process's peak resident set size (VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def record(i: int) -> tuple[str, bytes]:
    return f"key-{(i * 7919) % KEYS}", (b"%d:" % i).ljust(PAYLOAD, b"x")


# ----------------------------------------------------------------------------- a. group


async def member_main(url: str, stream: str, group: str, member: str, progress: str) -> None:
    """One group member in this (child) process: a no-op handler that keeps each
    partition's highest stream sequence; progress goes to ``progress`` every 50 ms."""
    high: dict[int, int] = {}
    handled = 0

    def one(msg: Any) -> None:
        nonlocal handled
        handled += 1
        if msg.stream_seq > high.get(msg.partition, 0):
            high[msg.partition] = msg.stream_seq

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    nc = await nats.connect(url)
    w = Worker(nc, WorkerConfig(stream, group, member_id=member), one)
    started = time.time()
    await w.start()
    out = Path(progress)
    while True:
        tmp = out.with_suffix(".tmp")
        state = {"started": started, "handled": handled, "high": high, "claimed": len(w.claimed)}
        tmp.write_text(json.dumps(state))
        tmp.replace(out)
        if stop.is_set():
            break
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.05):
                await stop.wait()
    await w.stop()
    await nc.close()


async def publish_backlog(url: str, stream: str, partitions: int, n: int) -> dict[int, int]:
    """Provision ``stream`` and publish ``n`` records; each partition's last stream seq."""
    nc = await nats.connect(url)
    await provision(nc, StreamSpec(stream, partitions=partitions))
    async with OrderedPublisher(nc, stream, producer_id=f"growth-{stream}") as pub:
        for i in range(n):
            await pub.publish(*record(i))
    await nc.close()
    assert pub.summary is not None and pub.summary.failed == 0, pub.summary
    return pub.summary.high_water_marks


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


async def drain(url: str, work: Path, stream: str, last: dict[int, int], members: int) -> dict:
    """Start ``members`` member processes at once; time until every partition's last
    record was handled. Returns rate, seconds and re-deliveries."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    files = [work / f"{group}-{i}.json" for i in range(members)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--member", url, stream, group, f"m{i}", str(f)]
        )
        for i, f in enumerate(files)
    ]
    targets = {p: s for p, s in last.items() if s}
    done_at = None
    settled: tuple[float, int] | None = None  # (when, handled by then)
    last_progress, last_t = -1, time.time()
    try:
        while True:
            await asyncio.sleep(0.02)
            states = [s for s in (_read(f) for f in files) if s is not None]
            high: dict[int, int] = {}
            for s in states:
                for p, seq in s["high"].items():
                    high[int(p)] = max(high.get(int(p), 0), seq)
            handled = sum(s["handled"] for s in states)
            if (
                settled is None
                and len(states) == members
                and sum(s["claimed"] for s in states) == len(last)
                and all(s["claimed"] for s in states)
            ):
                settled = time.time(), handled
            if len(states) == members and all(high.get(p, 0) >= s for p, s in targets.items()):
                done_at = time.time()
                break
            if handled != last_progress:
                last_progress, last_t = handled, time.time()
            elif time.time() - last_t > STALL:
                raise RuntimeError(f"no progress for {STALL:g}s at {handled} handled")
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"member exited with {p.returncode}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    states = [s for s in (_read(f) for f in files) if s is not None]
    t0 = min(s["started"] for s in states)
    handled = sum(s["handled"] for s in states)
    total = N
    if settled is None:  # done before every member claimed its share (1 partition each)
        settled = done_at, handled
    return {
        "seconds": done_at - t0,
        "rate": total / (done_at - t0),
        "redelivered": handled - total,
        # from t0 until every partition was claimed, every member holding some
        "settle": settled[0] - t0,
        "handled_by_settle": settled[1],
        # the rate after that: the steady per-record cost, without the set-up
        "steady_rate": (handled - settled[1]) / max(1e-3, done_at - settled[0]),
    }


async def section_group(url: str, work: Path) -> dict[str, Any]:
    lasts = {}
    for p in PARTS:
        t0 = time.perf_counter()
        lasts[p] = await publish_backlog(url, f"GROW{p}", p, N)
        log(
            f"backlog GROW{p}: {N:,} records over {p} partitions in {time.perf_counter() - t0:.1f}s"
        )
    configs = [(m, p) for p in PARTS for m in MEMBERS]
    base = (MEMBERS[0], PARTS[0])
    runs: dict[str, list[dict]] = {f"{m}x{p}": [] for m, p in configs}
    ratios: dict[str, list[float]] = {f"{m}x{p}": [] for m, p in configs}
    for rnd in range(ROUNDS):
        order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
        got = {}
        for m, p in order:
            res = await drain(url, work, f"GROW{p}", lasts[p], m)
            got[(m, p)] = res
            runs[f"{m}x{p}"].append(res)
            log(
                f"  round {rnd + 1} {m} member(s) x {p:3d} partitions: {res['rate']:>8,.0f} "
                f"msg/s ({res['seconds']:.2f}s; settled after {res['settle']:.2f}s with "
                f"{res['handled_by_settle']:,} handled, then {res['steady_rate']:,.0f} msg/s; "
                f"{res['redelivered']} re-delivered)"
            )
        for m, p in configs:
            ratios[f"{m}x{p}"].append(got[(m, p)]["rate"] / got[base]["rate"])
    return {
        "n": N,
        "rounds": ROUNDS,
        "runs": runs,
        "ratios": ratios,
        "base": f"{base[0]}x{base[1]}",
    }


def print_group(res: dict[str, Any]) -> None:
    print(
        f"\ngroup throughput: {res['n']:,} records, ratio to {res['base']} (members x partitions)"
    )
    print(
        f"{'members':>7s} {'partitions':>10s} {'msg/s (median)':>15s} {'x base':>7s} "
        f"{'(min..max)':>12s} {'settle s':>9s} {'steady msg/s':>13s} {'re-delivered':>13s}"
    )
    for name, rs in res["runs"].items():
        m, p = name.split("x")
        r = res["ratios"][name]
        print(
            f"{m:>7s} {p:>10s} {statistics.median(x['rate'] for x in rs):>15,.0f} "
            f"{statistics.median(r):>7.2f} {min(r):>5.2f}..{max(r):<5.2f} "
            f"{statistics.median(x['settle'] for x in rs):>9.2f} "
            f"{statistics.median(x['steady_rate'] for x in rs):>13,.0f} "
            f"{statistics.median(x['redelivered'] for x in rs):>13,.0f}"
        )


# ----------------------------------------------------------------------------- b. publisher


async def publish_child(url: str, stream: str, n: int) -> None:
    nc = await nats.connect(url, pending_size=8 * 1024 * 1024)
    t0 = time.perf_counter()
    async with OrderedPublisher(nc, stream, producer_id="growth") as pub:
        for i in range(n):
            await pub.publish(*record(i))
    elapsed = time.perf_counter() - t0
    await nc.close()
    assert pub.summary is not None and pub.summary.acked == n, pub.summary
    print(json.dumps({"peak_kib": peak_rss_kib(), "seconds": elapsed, "n": n}))


async def section_publisher(url: str) -> dict[str, Any]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    out: dict[str, Any] = {}
    for n in [1000, *PUB_N]:
        stream = f"GROWPUB{n}"
        await provision(nc, StreamSpec(stream, partitions=16))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--publish-child",
            url,
            stream,
            str(n),
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await proc.communicate()
        await js.delete_stream(stream)
        if proc.returncode != 0:
            raise RuntimeError(f"publisher child for {n} records failed (exit {proc.returncode})")
        res = json.loads(stdout.decode().strip().splitlines()[-1])
        out[str(n)] = res
        log(
            f"  publisher {n:>10,} records: peak RSS {res['peak_kib'] / 1024:.1f} MiB, "
            f"{res['seconds']:.1f}s ({n / res['seconds']:,.0f} msg/s)"
        )
    await nc.close()
    return out


def print_publisher(res: dict[str, Any]) -> None:
    base = res["1000"]["peak_kib"]
    first = str(PUB_N[0])
    per0 = res[first]["seconds"] / res[first]["n"]
    print("\npublisher size: peak RSS and time (baseline: the same child with 1,000 records)")
    print(
        f"{'records':>12s} {'peak RSS MiB':>13s} {'above base MiB':>15s} {'seconds':>8s} "
        f"{'msg/s':>9s} {'time/record x ' + first:>22s}"
    )
    for n, r in res.items():
        print(
            f"{int(n):>12,} {r['peak_kib'] / 1024:>13.1f} {(r['peak_kib'] - base) / 1024:>15.1f} "
            f"{r['seconds']:>8.1f} {r['n'] / r['seconds']:>9,.0f} "
            f"{r['seconds'] / r['n'] / per0:>22.2f}"
        )


# ----------------------------------------------------------------------------- main


async def amain(sections: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="growth-") as tmp, NatsServer(Path(tmp)) as srv:
        log(f"nats-server {srv.url}, sections {sorted(sections)}")
        work = Path(tmp) / "work"
        work.mkdir()
        if "group" in sections:
            out["group"] = await section_group(srv.url, work)
        if "publisher" in sections:
            out["publisher"] = await section_publisher(srv.url)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="group,publisher", help="group, publisher (both)")
    a = ap.parse_args(argv)
    sections = {s.strip() for s in a.sections.split(",") if s.strip()}
    if sections - {"group", "publisher"}:
        ap.error(f"unknown sections {sorted(sections - {'group', 'publisher'})}")
    res = asyncio.run(amain(sections))
    if "group" in res:
        print_group(res["group"])
    if "publisher" in res:
        print_publisher(res["publisher"])
    Path(".bench").mkdir(exist_ok=True)
    Path(".bench/growth.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--member"]:
        asyncio.run(member_main(*sys.argv[2:7]))
        sys.exit(0)
    if sys.argv[1:2] == ["--publish-child"]:
        asyncio.run(publish_child(sys.argv[2], sys.argv[3], int(sys.argv[4])))
        sys.exit(0)
    sys.exit(main())
