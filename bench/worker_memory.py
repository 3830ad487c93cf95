"""Sections c and d of ``bench/worker_bench.py``: a worker's memory over a long drain and
with 1 MB records."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats
from worker_common import (
    BACKLOG_STREAM,
    BENCH_DIR,
    PARTITIONS,
    PAYLOAD,
    STALL,
    Settings,
    _pdeathsig,
    connect,
    log,
    rss_kib,
    spawn_member,
    stop_member,
    trouble,
)

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

# ----------------------------------------------------------------------------- c. memory


async def section_memory(url: str, work: Path, st: Settings) -> dict[str, Any]:
    progress = work / "progress"
    every = 1000
    env = {"BENCH_PROGRESS": str(progress), "BENCH_PROGRESS_EVERY": str(every)}
    group = f"mem-{uuid.uuid4().hex[:6]}"
    m = spawn_member(
        url, work, BACKLOG_STREAM, group, "mem", "bench_handlers:Progress", env, ttl=5.0
    )
    samples: list[tuple[float, int, int]] = []  # (t since spawn, rss KiB, count)
    target = st.n - st.n % every
    count = 0
    changed = time.monotonic()
    outcome = "drained"
    try:
        while count < target:
            if m.proc.poll() is not None:
                outcome = f"worker exited early (code {m.proc.returncode})"
                break
            with contextlib.suppress(OSError, ValueError, IndexError):
                c = int(progress.read_text().split()[0])
                if c != count:
                    count, changed = c, time.monotonic()
            # start-up (imports, connect, claims) gets 10 s more before the first progress
            if time.monotonic() - changed > STALL + (10 if count == 0 else 0):
                outcome = f"STALLED at {count:,} (no progress for {STALL:g}s)"
                log(f"  memory worker {outcome}")
                break
            rss = rss_kib(m.proc.pid)
            if rss is not None:
                samples.append((time.time() - m.spawned, rss, count))
                if len(samples) % 10 == 0:
                    log(f"  memory: {count:,}/{st.n:,} drained, RSS {rss / 1024:.1f} MiB")
            await asyncio.sleep(0.5)
    finally:
        rc = stop_member(m)
    drained = [s for s in samples if s[2] > 0]

    def at(frac: float) -> int | None:
        return next((s[1] for s in drained if s[2] >= frac * st.n), None)

    r10, r50, r90 = at(0.1), at(0.5), at(0.9)
    peak = max((s[1] for s in drained), default=None)
    rate = None
    if len(drained) >= 2 and drained[-1][0] > drained[0][0]:
        rate = (drained[-1][2] - drained[0][2]) / (drained[-1][0] - drained[0][0])
    res = {
        "n": st.n,
        "samples": samples,
        "rss_kib": {"at10": r10, "at50": r50, "at90": r90, "max": peak},
        "max_over_at10": (peak / r10) if peak and r10 else None,
        "drain_rate": rate,
        "exit_code": rc,
        "outcome": outcome,
        "count": count,
        "trouble_lines": len(problems := trouble(m)),
        "trouble": problems[:20],
    }
    return res


def print_memory(res: dict[str, Any], raw_rate: float | None) -> None:
    r = res["rss_kib"]

    def mib(k: int | None) -> str:
        return "n/a" if k is None else f"{k / 1024:.1f} MiB"

    print(f"\nc. memory: one CLI worker process draining {res['n']:,} records (VmRSS / 0.5 s)")
    if res["outcome"] != "drained":
        print(f"INCOMPLETE: {res['outcome']}; figures below cover what was drained")
    print(
        f"RSS @10% {mib(r['at10'])}   @50% {mib(r['at50'])}   @90% {mib(r['at90'])}   "
        f"max {mib(r['max'])}"
    )
    ratio = res["max_over_at10"]
    if ratio is not None:
        print(f"max / RSS@10% = {ratio:.2f} ({'flat' if ratio < 1.3 else 'NOT flat'}: < 1.3)")
    if res["drain_rate"]:
        extra = ""
        if raw_rate:
            extra = f" (~{res['drain_rate'] / raw_rate:.2f} x raw-ordered median of a.)"
        print(f"drain rate of the CLI process {res['drain_rate']:,.0f} msg/s{extra}")
    print(f"exit code after SIGTERM: {res['exit_code']}")
    if res["trouble"]:
        n, first = res["trouble_lines"], res["trouble"][0]
        print(f"the worker logged {n:,} problem line(s), first: {first}")


# ----------------------------------------------------------------------------- d. memory, 1 MB

BIG_STREAM = "WBIG"
BIG_PAYLOAD = 1_000_000  # the server's default max_payload is 1 MiB, headers included
BIG_HANDLER_DELAY = 0.05  # seconds per message: slower than the server can send


async def _member_main(url: str, stream: str, group: str, progress: str, max_buffer: int) -> None:
    """One Worker in this (child) process: a slow async handler, so that the reader's
    buffers stay as full as its bounds allow; the count goes to ``progress`` now and then."""
    count = 0

    async def slow(msg: Any) -> None:
        nonlocal count
        await asyncio.sleep(BIG_HANDLER_DELAY)
        count += 1

    nc = await nats.connect(url)
    cfg = WorkerConfig(stream, group, member_id="big", max_buffer_bytes=max_buffer)
    w = Worker(nc, cfg, slow)
    await w.start()
    while True:
        Path(progress).write_text(str(count))
        await asyncio.sleep(0.05)


async def section_memory_big(url: str, work: Path, st: Settings) -> dict[str, Any]:
    """The same slow worker (a child process) drains BENCH_BIG_N records three times, with
    a fresh group each: 100-byte records (the baseline), 1 MB records with the default
    ``max_buffer_bytes``, and 1 MB records with the byte bound lifted (counts only, as before
    the bound existed). Peak VmRSS of each, sampled every 0.1 s."""
    n = st.big_n
    nc = await connect(url)
    for name, size in ((f"{BIG_STREAM}S", PAYLOAD), (BIG_STREAM, BIG_PAYLOAD)):
        await provision(nc, StreamSpec(name, partitions=PARTITIONS))
        async with OrderedPublisher(nc, name, producer_id=f"big-{uuid.uuid4().hex[:6]}") as pub:
            for i in range(n):
                await pub.publish(f"key-{i}", (b"%d:" % i).ljust(size, b"x"))
    await nc.close()
    default = WorkerConfig("S", "g").max_buffer_bytes
    runs = [
        ("100 B, default bound", f"{BIG_STREAM}S", default),
        ("1 MB, default bound", BIG_STREAM, default),
        ("1 MB, counts only", BIG_STREAM, 1 << 40),
    ]
    out: dict[str, Any] = {"n": n, "payload": BIG_PAYLOAD, "max_buffer_bytes": default}
    for label, stream, bound in runs:
        progress = work / f"big-{uuid.uuid4().hex[:6]}"
        cmd = [sys.executable, str(BENCH_DIR / "worker_bench.py"), "--member"]
        cmd += [url, stream, f"big-{uuid.uuid4().hex[:6]}", str(progress), str(bound)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig())
        peak = idle = 0
        count, t0, changed = 0, time.monotonic(), time.monotonic()
        try:
            while count < n and time.monotonic() - changed < STALL + 10:
                with contextlib.suppress(OSError, ValueError):
                    c = int(progress.read_text() or 0)
                    if c != count:
                        count, changed = c, time.monotonic()
                rss = rss_kib(proc.pid) or 0
                if count == 0:
                    idle = max(idle, rss)
                peak = max(peak, rss)
                await asyncio.sleep(0.1)
        finally:
            proc.kill()
            proc.wait()
        elapsed = time.monotonic() - t0
        out[label] = {"peak_kib": peak, "count": count, "elapsed": elapsed}
        log(f"  d. {label}: peak RSS {peak / 1024:.1f} MiB, {count:,}/{n:,} in {elapsed:.1f}s")
    return out


def print_memory_big(res: dict[str, Any]) -> None:
    n, bound = res["n"], res["max_buffer_bytes"]
    print(
        f"\nd. memory with 1 MB records: one worker process, a slow handler "
        f"({BIG_HANDLER_DELAY * 1000:g} ms per message), {n:,} records over {PARTITIONS} "
        f"partitions; max_buffer_bytes default {bound / 2**20:g} MiB"
    )
    base = res["100 B, default bound"]["peak_kib"]
    for label in ("100 B, default bound", "1 MB, default bound", "1 MB, counts only"):
        r = res[label]
        ratio = r["peak_kib"] / base if base else float("nan")
        extra = (r["peak_kib"] - base) / 1024
        done = "" if r["count"] >= n else f"  INCOMPLETE {r['count']:,}/{n:,}"
        print(
            f"{label:22s} peak RSS {r['peak_kib'] / 1024:7.1f} MiB  {ratio:5.2f} x baseline  "
            f"(+{extra:6.1f} MiB){done}"
        )


# ----------------------------------------------------------------------------- main
