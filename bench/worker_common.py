"""What the sections of ``bench/worker_bench.py`` share: settings, the backlog, timing
helpers, and worker processes started through the CLI."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

PARTITIONS = 16
PAYLOAD = 100
TTL = 2.0
#: the pid of the run's nats-server (set by main())
SERVER_PID: int | None = None
BENCH_DIR = Path(__file__).resolve().parent
BACKLOG_STREAM = "WBENCH"
FAILOVER_STREAM = "WFAIL"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@dataclass
class Settings:
    n: int
    rounds: int
    ack1_n: int
    reps: int
    trickle: int
    sections: set[str]
    big_n: int = 480

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> Settings:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--quick", action="store_true", help="small N, fewer rounds")
        ap.add_argument(
            "--sections",
            default="throughput,failover,server-loss,redelivery,memory,memory-1mb",
            help="comma list of throughput, failover, server-loss, redelivery, memory, "
            "memory-1mb (default: all)",
        )
        a = ap.parse_args(argv)
        env = os.environ.get
        q = a.quick
        sections = {s.strip() for s in a.sections.split(",") if s.strip()}
        unknown = sections - {
            "throughput",
            "failover",
            "server-loss",
            "redelivery",
            "memory",
            "memory-1mb",
        }
        if unknown:
            ap.error(f"unknown sections {sorted(unknown)}")
        n = int(env("BENCH_WORKER_N", "50000" if q else "1000000"))
        return cls(
            n=n,
            rounds=int(env("BENCH_ROUNDS", "2" if q else "3")),
            ack1_n=min(n, int(env("BENCH_ACK1_N", "5000" if q else "50000"))),
            reps=int(env("BENCH_FAILOVER_REPS", "1" if q else "3")),
            trickle=int(env("BENCH_TRICKLE", "200")),
            sections=sections,
            big_n=int(env("BENCH_BIG_N", "160" if q else "480")),
        )


# ----------------------------------------------------------------------------- backlog


async def publish_backlog(nc: NATS, stream: str, n: int) -> str:
    spec = StreamSpec(stream, partitions=PARTITIONS)
    await provision(nc, spec)
    t0 = time.perf_counter()
    async with OrderedPublisher(nc, stream, producer_id=f"wbench-{uuid.uuid4().hex[:6]}") as pub:
        for i in range(n):
            await pub.publish(f"key-{(i * 7919) % 5000}", (b"%d:" % i).ljust(PAYLOAD, b"x"))
            if i and i % 200_000 == 0:
                log(f"  published {i:,}")
    assert pub.summary is not None and pub.summary.failed == 0, pub.summary
    stored = (await nc.jetstream().stream_info(stream)).state.messages
    log(
        f"backlog: {stored:,} records in {stream} "
        f"({n / (time.perf_counter() - t0):,.0f} msg/s published)"
    )
    if stored != n:
        raise RuntimeError(f"backlog has {stored} records, expected {n}")
    return spec.prefix


# ----------------------------------------------------------------------------- a. throughput


#: errors nats-py reported on the benchmark's own connections, by type (slow consumers, ...)
CLIENT_ERRORS: Counter[str] = Counter()
STALL = float(os.environ.get("BENCH_STALL", "20"))


async def connect(url: str) -> NATS:
    """A connection whose async errors are counted (and not printed once per message)."""

    async def error_cb(exc: Exception) -> None:
        CLIENT_ERRORS[type(exc).__name__] += 1

    return await nats.connect(url, error_cb=error_cb)


@dataclass
class Run:
    """One variant's read: ``count`` of ``target`` records in ``elapsed`` seconds."""

    elapsed: float
    count: int
    target: int
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.count >= self.target

    @property
    def rate(self) -> float:
        return self.count / self.elapsed if self.elapsed > 0 else 0.0


async def wait_progress(get: Callable[[], int], target: int, t0: float) -> tuple[int, float]:
    """Wait until ``get() >= target`` or it made no progress for STALL seconds.

    Returns (count, seconds from t0 to the last progress)."""
    last, last_t = get(), time.perf_counter()
    while last < target:
        await asyncio.sleep(0.01)
        now, c = time.perf_counter(), get()
        if c != last:
            last, last_t = c, now
        elif now - last_t > STALL:
            log(f"  STALLED at {last:,}/{target:,} (no progress for {STALL:g}s)")
            break
    return last, last_t - t0


def errors_since(before: Counter[str]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in CLIENT_ERRORS.items() if v != before.get(k, 0)}


# ----------------------------------------------------------------------------- processes


def _pdeathsig() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: die with the benchmark

    return preexec


def cli_path() -> list[str]:
    exe = Path(sys.executable).parent / "nats-ordered"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("nats-ordered")
    if found:
        return [found]
    return [sys.executable, "-c", "from airflow_nats_ordered.cli import main; main()"]


@dataclass
class Member:
    name: str
    proc: subprocess.Popen[bytes]
    stderr_path: Path
    spawned: float
    joined: float | None = None

    def check_joined(self) -> None:
        if self.joined is None:
            with contextlib.suppress(OSError):
                if b" joined group " in self.stderr_path.read_bytes():
                    self.joined = time.time()


def spawn_member(
    url: str,
    work: Path,
    stream: str,
    group: str,
    name: str,
    handler: str,
    env_extra: dict[str, str],
    audit: Path | None = None,
    ttl: float = TTL,
    extra: Sequence[str] = (),
) -> Member:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH", "")) if p)
    env["BENCH_MEMBER"] = name
    env.update(env_extra)
    cmd = cli_path() + [
        "worker",
        "--stream",
        stream,
        "--group",
        group,
        "--handler",
        handler,
        "--member-id",
        name,
        "--lease-ttl",
        f"{ttl:g}",
        "--server",
        url,
    ]
    if audit is not None:
        cmd += ["--audit-log", str(audit)]
    cmd += extra
    err = work / f"{name}.stderr"
    with err.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_pdeathsig(),
        )
    return Member(name, proc, err, time.time())


def stop_member(m: Member, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
    """Signal the member once and wait for it (a second SIGTERM would make it exit at once)."""
    if m.proc.poll() is None:
        with contextlib.suppress(OSError):
            m.proc.send_signal(sig)
    return reap(m, timeout)


TROUBLE = (
    "expired locally",
    "was lost",
    "fenced off",
    "failed",
    "SlowConsumer",
    "Traceback",
    "ERROR",
)


def trouble(m: Member) -> list[str]:
    """Lines of the member's output that tell of lost leases, fencing or crashes."""
    try:
        text = m.stderr_path.read_text(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if any(t in ln for t in TROUBLE)]


def reap(m: Member, timeout: float = 15.0) -> int | None:
    """Wait for an already signalled member; SIGKILL it after ``timeout`` (returns None)."""
    try:
        return m.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        m.proc.kill()
        m.proc.wait()
        return None


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
