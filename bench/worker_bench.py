"""`make bench` (second half): the worker's throughput, failover and memory, on a real server.

Everything runs against one embedded nats-server (file storage). These machines are shared
and noisy, so throughput figures are ratios to a baseline measured in the same round, with
the variants interleaved (rotated order) over several rounds; medians and min..max.

a. Throughput: one 16-partition stream with a backlog of BENCH_WORKER_N 100-byte records
   (published once with the OrderedPublisher); each variant reads the whole backlog.
     raw-ordered    nats-py ordered push consumer over all partitions, no-op callback: 1.00
     worker         one in-process Worker (fresh group each round), no-op handler, defaults;
                    timed from ``start()`` until the handler has seen all N
     worker-batch   the same with ``batch_handler=True``
     ack-pending-1  the per-message-ack design: one durable push consumer per partition,
                    ``ack_policy=explicit``, ``max_ack_pending=1``, ack after the no-op handler,
                    16 partitions at once; run on a subset (BENCH_ACK1_N) and compared by rate
   Goal: worker >= 1.0 x raw-ordered (issue 19; it was 0.5 x).
b. Failover, with worker PROCESSES started through the CLI (``--lease-ttl 2``) and the
   ``bench_handlers:Recorder`` handler logging every apply (wall time, member, partition,
   seq); a background publisher trickles ~BENCH_TRICKLE msg/s, round-robin over the
   partitions, so there is always something to apply.
     kill       SIGKILL an owner -> first apply by another member on one of its partitions
                (goal <= TTL + 1 s); "all" = until every one of its partitions was applied
     graceful   SIGTERM an owner -> the same (goal <= 0.5 s)
     join       start a member -> every partition owned again and the new member applied
                its first message; from the spawn (includes interpreter start-up) and from
                the moment the process printed "joined"
   Seconds (absolute: these are dominated by the TTL) and as a fraction of the TTL. Lines
   where a member logged a lost lease, fencing or a failure are reported; the apply log,
   audit log and member outputs are kept in ``.bench/worker-failover-logs/``.
b3. Re-deliveries per SIGKILL (``redelivery``, bench/redelivery.py): two CLI members drain
   BENCH_REDELIVERY_N records, one is SIGKILLed at a third; re-deliveries, the drain rate
   and commit writes/s, against the commit cadence before issue 19 in the same run.
c. Memory: one CLI worker process drains the backlog with a fresh group; its VmRSS is
   sampled every 0.5 s; RSS at 10 %, 50 %, 90 % of the drain and the max. "Flat" means
   max / RSS@10% < 1.3 (reported, not asserted).
d. Memory with 1 MB records: a worker in a child process with a slow handler (50 ms per
   message, so its buffers stay as full as their bounds allow) drains BENCH_BIG_N records
   (default 480, over 16 partitions) three times: 100-byte records (the baseline, measured
   in the same run), 1 MB records with the default ``max_buffer_bytes`` (64 MiB), and 1 MB
   records with the byte bound lifted (counts only: 2 x ``fetch_batch`` per partition, as
   before the bound existed). Peak VmRSS (every 0.1 s), as a ratio to the baseline.

Environment: BENCH_WORKER_N (default 1,000,000), BENCH_ROUNDS (3), BENCH_ACK1_N (50,000),
BENCH_FAILOVER_REPS (3), BENCH_TRICKLE (200 msg/s). ``--quick`` shrinks N, the rounds, the
subset and the repetitions; ``--sections throughput,failover,memory`` picks sections.
Writes ``.bench/worker.json`` (with the commit and a hash of the worker module measured).
The run time is dominated by section a (3 full reads of N per round) and c (one more): with
the defaults about 7.5 minutes on 2 cores at ~25k msg/s per worker (14 at ~10k msg/s);
BENCH_WORKER_N=500000 halves section a. A read that makes no progress for BENCH_STALL
seconds (default 20) is reported as stalled (rate up to the stall) instead of hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from cluster_failover import print_server_loss, section_server_loss
from nats.aio.client import Client as NATS
from nats.js import api
from redelivery import print_redelivery, section_redelivery

from airflow_nats_ordered.core.partitioning import (
    partition_for,
    partition_subject,
    partition_wildcard,
)
from airflow_nats_ordered.core.publisher import OrderedPublisher
from airflow_nats_ordered.core.streams import StreamSpec, provision
from airflow_nats_ordered.core.worker import Worker, WorkerConfig
from airflow_nats_ordered.embedded import NatsServer

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


async def v_raw_ordered(url: str, prefix: str, n: int, rnd: int) -> Run:
    nc = await connect(url)
    before = Counter(CLIENT_ERRORS)
    count = 0

    async def cb(msg: Any) -> None:
        nonlocal count
        count += 1

    t0 = time.perf_counter()
    sub = await nc.jetstream().subscribe(
        partition_wildcard(prefix), stream=BACKLOG_STREAM, ordered_consumer=True, cb=cb
    )
    got, elapsed = await wait_progress(lambda: count, n, t0)
    await sub.unsubscribe()
    await nc.close()
    return Run(elapsed, got, n, errors_since(before))


WORKER_STATS: list[dict[str, Any]] = []


async def _worker_run(url: str, n: int, rnd: int, batch: bool) -> Run:
    nc = await connect(url)
    before = Counter(CLIENT_ERRORS)
    count = calls = 0
    high = [0] * PARTITIONS  # count progress, not re-deliveries (after a lost lease, say)

    def one(msg: Any) -> None:
        nonlocal count, calls
        calls += 1
        if msg.stream_seq > high[msg.partition]:
            high[msg.partition] = msg.stream_seq
            count += 1

    def many(msgs: list[Any]) -> None:
        for m in msgs:
            one(m)

    group = f"tp{rnd}{'b' if batch else ''}-{uuid.uuid4().hex[:6]}"
    cfg = WorkerConfig(BACKLOG_STREAM, group, member_id="bench", batch_handler=batch)
    w = Worker(nc, cfg, many if batch else one)
    t0 = time.perf_counter()
    await w.start()
    got, elapsed = await wait_progress(lambda: count, n, t0)
    await w.stop()
    errors = errors_since(before)
    WORKER_STATS.append(
        {"variant": "worker-batch" if batch else "worker", "round": rnd, "calls": calls}
        | w.stats
        | {"count": got, "client_errors": errors}
    )
    if calls != got or w.stats["leases_lost"] or w.stats["fenced"] or errors:
        log(f"  note: {calls - got} re-deliveries, stats {w.stats}, client errors {errors}")
    js = nc.jetstream()
    for bucket in (cfg.group_config.lease_bucket, cfg.group_config.state_bucket):
        with contextlib.suppress(Exception):
            await js.delete_key_value(bucket)
    await nc.close()
    return Run(elapsed, got, n, errors)


async def v_worker(url: str, prefix: str, n: int, rnd: int) -> Run:
    return await _worker_run(url, n, rnd, batch=False)


async def v_worker_batch(url: str, prefix: str, n: int, rnd: int) -> Run:
    return await _worker_run(url, n, rnd, batch=True)


def make_ack1(subset: int) -> Callable[..., Any]:
    async def v_ack_pending_1(url: str, prefix: str, n: int, rnd: int) -> Run:
        nc = await connect(url)
        before = Counter(CLIENT_ERRORS)
        js = nc.jetstream()
        per = subset // PARTITIONS
        counts = [0] * PARTITIONS
        subs = []
        names = []

        def make_cb(p: int) -> Callable[[Any], Any]:
            async def cb(msg: Any) -> None:
                # the no-op handler, then the ack that lets the server send the next one
                await msg.ack()
                if counts[p] < per:
                    counts[p] += 1

            return cb

        t0 = time.perf_counter()
        for p in range(PARTITIONS):
            name = f"ack1_{rnd}_{p}_{uuid.uuid4().hex[:4]}"
            names.append(name)
            subject = partition_subject(prefix, p)
            cfg = api.ConsumerConfig(
                durable_name=name,
                ack_policy=api.AckPolicy.EXPLICIT,
                max_ack_pending=1,
                deliver_policy=api.DeliverPolicy.ALL,
                filter_subject=subject,
                ack_wait=30,
            )
            subs.append(
                await js.subscribe(
                    subject, stream=BACKLOG_STREAM, config=cfg, cb=make_cb(p), manual_ack=True
                )
            )
        got, elapsed = await wait_progress(lambda: sum(counts), per * PARTITIONS, t0)
        for s in subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        for name in names:
            with contextlib.suppress(Exception):
                await js.delete_consumer(BACKLOG_STREAM, name)
        await nc.close()
        return Run(elapsed, got, per * PARTITIONS, errors_since(before))

    return v_ack_pending_1


async def section_throughput(url: str, prefix: str, st: Settings) -> dict[str, Any]:
    variants: dict[str, Callable[..., Any]] = {
        "raw-ordered": v_raw_ordered,
        "worker": v_worker,
        "worker-batch": v_worker_batch,
        "ack-pending-1": make_ack1(st.ack1_n),
    }
    rates: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    complete: dict[str, bool] = {v: True for v in variants}
    runs: list[dict[str, Any]] = []
    names = list(variants)
    for rnd in range(st.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        got = {}
        for name in order:
            await asyncio.sleep(0.5)  # let the server settle between variants
            run: Run = await variants[name](url, prefix, st.n, rnd)
            got[name] = run.rate
            complete[name] &= run.complete
            runs.append(
                {"variant": name, "round": rnd, "rate": run.rate, "count": run.count}
                | {"target": run.target, "elapsed": run.elapsed, "client_errors": run.errors}
            )
            log(
                f"  round {rnd + 1} {name:13s} {run.rate:>10,.0f} msg/s "
                f"({run.count:,} in {run.elapsed:.2f}s)"
                + ("" if run.complete else f"  INCOMPLETE: {run.count:,}/{run.target:,}")
            )
        for name, rate in got.items():
            rates[name].append(rate)
            ratios[name].append(rate / got["raw-ordered"] if got["raw-ordered"] else 0.0)
    return {
        "rates": rates,
        "ratios_vs_raw_ordered": ratios,
        "complete": complete,
        "runs": runs,
        "worker_stats": WORKER_STATS,
    }


def print_throughput(res: dict[str, Any], st: Settings) -> None:
    rates, ratios = res["rates"], res["ratios_vs_raw_ordered"]
    print(
        f"\na. throughput: {st.n:,} x {PAYLOAD} B backlog, {PARTITIONS} partitions, "
        f"{st.rounds} rounds (ack-pending-1 on {st.ack1_n:,})"
    )
    print(
        f"{'variant':14s} {'msg/s (median)':>15s} {'x raw-ordered':>14s} {'(min..max)':>14s}"
        "  read all"
    )
    for name in rates:
        r = ratios[name]
        print(
            f"{name:14s} {med(rates[name]):>15,.0f} {med(r):>14.2f} {min(r):>7.2f}..{max(r):<6.2f}"
            f"  {'yes' if res['complete'][name] else 'NO (stalled; rate up to the stall)'}"
        )
    w = med(ratios["worker"])
    lost = sum(x["leases_lost"] + x["fenced"] for x in res["worker_stats"])
    redelivered = sum(x["calls"] - x["count"] for x in res["worker_stats"])
    errs: Counter[str] = Counter()
    for x in res["worker_stats"]:
        errs.update(x["client_errors"])
    if lost or redelivered or errs:
        print(
            f"in-process workers: {lost} leases lost/fenced, {redelivered} re-deliveries, "
            f"client errors {dict(errs) or 'none'}"
        )
    print(
        f"worker = {w:.2f} x raw ordered consumer "
        f"({'meets' if w >= 1.0 else 'MISSES'} issue 19's >= 1.0 x goal); "
        f"batch handler {med(ratios['worker-batch']):.2f} x"
    )


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


# ----------------------------------------------------------------------------- b. failover


class Tail:
    """Read the complete lines appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.buf = b""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.buf + data
        *complete, self.buf = data.split(b"\n")
        return [x.decode() for x in complete if x]


@dataclass
class Observed:
    """Everything the failover members wrote: applies, lease windows, releases, assignments."""

    apply_log: Path
    audit_log: Path
    applies: list[tuple[float, str, int, int]] = field(default_factory=list)
    leases: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # per partition
    released: list[dict[str, Any]] = field(default_factory=list)
    assignments: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    last_apply: dict[int, tuple[float, str]] = field(default_factory=dict)  # p -> (wall, member)
    first_apply: dict[str, float] = field(default_factory=dict)  # member -> wall

    def __post_init__(self) -> None:
        self._ta = Tail(self.apply_log)
        self._tl = Tail(self.audit_log)

    def poll(self) -> None:
        for line in self._ta.lines():
            t, member, p, seq = line.split()
            rec = (float(t), member, int(p), int(seq))
            self.applies.append(rec)
            self.last_apply[rec[2]] = (rec[0], member)
            self.first_apply.setdefault(member, rec[0])
        now = time.time()
        for line in self._tl.lines():
            ev = json.loads(line)
            kind = ev.get("kind")
            if kind == "lease":
                self.leases.setdefault(ev["partition"], []).append(ev)
            elif kind == "released":
                self.released.append(ev)
            elif kind == "assignment":
                self.assignments.append((now, ev))

    def owner_at(self, p: int, t: float) -> str | None:
        """The member holding partition p's lease at wall time t (per the audit log)."""
        best = None
        for ev in reversed(self.leases.get(p, ())):
            if ev["valid_from"] <= t and (best is None or ev["valid_from"] > best["valid_from"]):
                best = ev
                break
        if best is None or best["valid_until"] <= t:
            return None
        for ev in reversed(self.released):
            if ev["at"] < best["valid_from"]:
                break
            if ev["partition"] == p and ev["member"] == best["member"] and ev["at"] <= t:
                return None
        return best["member"]

    def leader(self) -> str | None:
        return self.assignments[-1][1]["member"] if self.assignments else None

    def assigned(self) -> dict[int, str]:
        if not self.assignments:
            return {}
        return {int(k): v for k, v in self.assignments[-1][1]["owners"].items()}

    def first_applies_after(
        self, start: int, t: float, parts: set[int], exclude: str
    ) -> dict[int, float]:
        """First apply per partition in ``parts`` after wall time t by anyone but ``exclude``,
        looking at the applies from index ``start`` on."""
        out: dict[int, float] = {}
        for wall, member, p, _ in self.applies[start:]:
            if wall > t and member != exclude and p in parts and p not in out:
                out[p] = wall
        return out


async def observe_until(obs: Observed, cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        obs.poll()
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)


async def steady(obs: Observed, members: dict[str, Member], timeout: float = 30.0) -> bool:
    """Every partition applied within the last second by its assigned live member, and the
    latest assignment names exactly the live members."""

    def ok() -> bool:
        now = time.time()
        owners = obs.assigned()
        if len(owners) != PARTITIONS or set(owners.values()) != set(members):
            return False
        for p in range(PARTITIONS):
            last = obs.last_apply.get(p)
            if last is None or now - last[0] > 1.0 or last[1] != owners[p]:
                return False
        return True

    good = await observe_until(obs, ok, timeout)
    if not good:
        log(f"  WARNING: group not steady after {timeout:.0f}s (live: {sorted(members)})")
    return good


async def trickle(url: str, stream: str, rate: int, stop: asyncio.Event) -> int:
    """Publish ~rate msg/s, round-robin over the partitions (one fixed key per partition)."""
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < PARTITIONS:
        keys.setdefault(partition_for(f"t{i}", PARTITIONS), f"t{i}")
        i += 1
    nc = await connect(url)
    sent = 0
    tick = 0.05
    per_tick = max(1, round(rate * tick))
    t0 = time.monotonic()
    async with OrderedPublisher(nc, stream, producer_id=f"trickle-{uuid.uuid4().hex[:6]}") as pub:
        while not stop.is_set():
            for _ in range(per_tick):
                await pub.publish(keys[sent % PARTITIONS], (b"%d:" % sent).ljust(PAYLOAD, b"t"))
                sent += 1
            await pub.flush()
            ticks = sent // per_tick
            await asyncio.sleep(max(0.0, t0 + ticks * tick - time.monotonic()))
    await nc.close()
    return sent


async def section_failover(url: str, work: Path, st: Settings) -> dict[str, Any]:
    nc = await connect(url)
    await provision(nc, StreamSpec(FAILOVER_STREAM, partitions=PARTITIONS))
    await nc.close()
    obs = Observed(work / "apply.log", work / "audit.log")
    group = "fo"
    env = {"BENCH_APPLY_LOG": str(obs.apply_log)}
    stop = asyncio.Event()
    pub_task = asyncio.ensure_future(trickle(url, FAILOVER_STREAM, st.trickle, stop))
    live: dict[str, Member] = {}
    everyone: list[Member] = []
    seq = 0
    kills: list[dict[str, Any]] = []
    graceful: list[dict[str, Any]] = []
    joins: list[dict[str, Any]] = []

    def new_member() -> Member:
        nonlocal seq
        name = f"m{seq}"
        seq += 1
        m = spawn_member(
            url, work, FAILOVER_STREAM, group, name, "bench_handlers:Recorder", env, obs.audit_log
        )
        live[name] = m
        everyone.append(m)
        return m

    async def measure_join() -> None:
        m = new_member()

        def settled() -> bool:
            m.check_joined()
            owners = obs.assigned()
            if m.name not in owners.values() or set(owners.values()) != set(live):
                return False
            now = time.time()
            if m.name not in obs.first_apply:
                return False
            return all(obs.owner_at(p, now) == owners[p] for p in range(PARTITIONS))

        ok = await observe_until(obs, settled, 30.0)
        owners = obs.assigned()
        moved = {p for p, o in owners.items() if o == m.name}
        first_apply = obs.first_apply.get(m.name, float("nan"))
        claims = {}
        for p in moved:
            mine = [ev["valid_from"] for ev in obs.leases.get(p, ()) if ev["member"] == m.name]
            if mine:
                claims[p] = min(mine)
        # how long each moved partition had no owner: old owner's release -> new claim
        gaps = []
        for p, claimed in claims.items():
            rel = [
                ev["at"]
                for ev in obs.released
                if ev["partition"] == p and m.spawned <= ev["at"] <= claimed
            ]
            if rel:
                gaps.append(claimed - max(rel))
        settle = max([first_apply, *claims.values()]) if claims else float("nan")
        sample = {
            "member": m.name,
            "ok": ok,
            "moved": sorted(moved),
            "from_spawn": settle - m.spawned,
            "from_joined": settle - m.joined if m.joined else None,
            "first_apply_from_spawn": first_apply - m.spawned,
            "max_unowned_gap": max(gaps) if gaps else None,
        }
        joins.append(sample)
        log(
            f"  join {m.name}: settled {sample['from_spawn']:.2f}s after spawn"
            + (f", {sample['from_joined']:.2f}s after 'joined'" if m.joined else "")
            + f"; {len(moved)} partitions moved, max unowned gap "
            + (f"{max(gaps):.3f}s" if gaps else "n/a")
        )
        await steady(obs, live)

    async def measure_loss(kind: str, want_leader: bool) -> None:
        obs.poll()
        leader = obs.leader()
        candidates = sorted(live, key=lambda n: int(n[1:]))
        victim = next(
            (n for n in candidates if (n == leader) == want_leader),
            candidates[0],
        )
        m = live.pop(victim)
        obs.poll()
        start = len(obs.applies)  # every apply after t0 is read after this poll
        t0 = time.time()
        parts = {p for p in range(PARTITIONS) if obs.owner_at(p, t0) == victim}
        sig = signal.SIGKILL if kind == "kill" else signal.SIGTERM
        m.proc.send_signal(sig)

        def taken_over() -> bool:
            return len(obs.first_applies_after(start, t0, parts, victim)) == len(parts)

        ok = await observe_until(obs, taken_over, 30.0)
        rc = reap(m)
        firsts = obs.first_applies_after(start, t0, parts, victim)
        sample = {
            "victim": victim,
            "was_leader": victim == leader,
            "ok": ok,
            "partitions": sorted(parts),
            "first": min(firsts.values()) - t0 if firsts else None,
            "all": max(firsts.values()) - t0 if firsts and len(firsts) == len(parts) else None,
            "exit_code": rc,
        }
        rels = [ev["at"] - t0 for ev in obs.released if ev["member"] == victim and ev["at"] > t0]
        if rels:
            sample["released_within"] = max(rels)
        (kills if kind == "kill" else graceful).append(sample)

        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}s"

        log(
            f"  {kind} {victim}{' (leader)' if victim == leader else ''}: first apply by the "
            f"new owner {fmt(sample['first'])}, all {len(parts)} partitions {fmt(sample['all'])}"
            f", exit {rc}"
        )
        await steady(obs, live)

    try:
        m0 = new_member()
        await steady(obs, live, timeout=60.0)
        log(f"  {m0.name} owns everything")
        await measure_join()
        for r in range(st.reps):
            await measure_loss("kill", want_leader=r % 2 == 0)
            await measure_join()
            await measure_loss("graceful", want_leader=r % 2 == 1)
            await measure_join()
    finally:
        for m in list(live.values()):
            stop_member(m)
        stop.set()
        sent = await pub_task
    log(f"  trickle published {sent:,} messages")
    issues = {m.name: trouble(m)[:20] for m in everyone if trouble(m)}
    keep = Path(".bench") / "worker-failover-logs"  # for a look after the run
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir(parents=True)
    for f in [obs.apply_log, obs.audit_log, *(m.stderr_path for m in everyone)]:
        with contextlib.suppress(OSError):
            shutil.copy(f, keep / f.name)
    for name, lines in issues.items():
        log(f"  {name} reported: {lines[0]}" + (f" (+{len(lines) - 1} more)" if lines[1:] else ""))
    return {
        "member_trouble": issues,
        "ttl": TTL,
        "trickle_rate": st.trickle,
        "kill": kills,
        "graceful": graceful,
        "join": joins,
    }


def _stats(xs: list[float | None]) -> tuple[float, float, int]:
    vals = [x for x in xs if x is not None]
    return (med(vals), max(vals) if vals else float("nan"), len(xs) - len(vals))


def print_failover(res: dict[str, Any]) -> None:
    ttl = res["ttl"]
    print(
        f"\nb. failover: CLI worker processes, lease TTL {ttl:g}s, trickle "
        f"~{res['trickle_rate']} msg/s over {PARTITIONS} partitions"
    )
    print(
        f"{'measure':36s} {'median':>8s} {'max':>8s} {'med/TTL':>8s} {'max/TTL':>8s} "
        f"{'goal':>9s}  n"
    )
    rows = [
        ("kill -> first apply by new owner", [s["first"] for s in res["kill"]], ttl + 1),
        ("kill -> all its partitions", [s["all"] for s in res["kill"]], None),
        ("SIGTERM -> first apply by new owner", [s["first"] for s in res["graceful"]], 0.5),
        ("SIGTERM -> all its partitions", [s["all"] for s in res["graceful"]], None),
        ("join settled, from spawn", [s["from_spawn"] for s in res["join"]], None),
        ("join settled, from 'joined'", [s["from_joined"] for s in res["join"]], None),
        ("join: max unowned gap", [s["max_unowned_gap"] for s in res["join"]], None),
    ]
    for label, xs, goal in rows:
        m, mx, missing = _stats(xs)
        verdict = ""
        if goal is not None:
            verdict = f"<={goal:g}s " + ("ok" if mx <= goal else "MISS")
        print(
            f"{label:36s} {m:>7.3f}s {mx:>7.3f}s {m / ttl:>8.2f} {mx / ttl:>8.2f} "
            f"{verdict:>9s}  {len(xs) - missing}" + (f" ({missing} missing)" if missing else "")
        )
    leader = [s["first"] for s in res["kill"] if s["was_leader"] and s["first"] is not None]
    other = [s["first"] for s in res["kill"] if not s["was_leader"] and s["first"] is not None]
    if leader and other:
        print(f"kill of the leader: median {med(leader):.3f}s; of a follower: {med(other):.3f}s")
    rcs = [s["exit_code"] for s in res["graceful"]]
    print(f"SIGTERM exit codes: {rcs}")
    for name, lines in res["member_trouble"].items():
        print(f"{name} reported {len(lines)} problem line(s), first: {lines[0]}")


# ----------------------------------------------------------------------------- c. memory


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


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
        cmd = [sys.executable, str(Path(__file__).resolve()), "--member"]
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


def code_version() -> dict[str, Any]:
    """Which code was measured: the commit, whether the tree is dirty, and a hash of the
    core's modules (CLI processes import the files as they are when they start; the worker
    is spread over several of them)."""
    import hashlib

    import airflow_nats_ordered.core as core_pkg

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=10, cwd=BENCH_DIR
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    src = b"".join(p.read_bytes() for p in sorted(Path(core_pkg.__file__).parent.glob("*.py")))
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "worker_py_sha256": hashlib.sha256(src).hexdigest()[:12],
    }


async def amain(st: Settings, url: str, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "code": code_version(),
        "n": st.n,
        "rounds": st.rounds,
        "ack1_n": st.ack1_n,
        "partitions": PARTITIONS,
        "payload": PAYLOAD,
    }
    t_all = time.monotonic()
    prefix = None
    if st.sections & {"throughput", "memory"}:
        log(f"publishing a backlog of {st.n:,} records ...")
        nc = await connect(url)
        prefix = await publish_backlog(nc, BACKLOG_STREAM, st.n)
        await nc.close()
    if "throughput" in st.sections:
        assert prefix is not None
        t0 = time.monotonic()
        log("a. throughput")
        out["throughput"] = await section_throughput(url, prefix, st)
        print_throughput(out["throughput"], st)
        log(f"a. took {time.monotonic() - t0:.0f}s")
    if "failover" in st.sections:
        t0 = time.monotonic()
        log("b. failover")
        out["failover"] = await section_failover(url, work, st)
        print_failover(out["failover"])
        log(f"b. took {time.monotonic() - t0:.0f}s")
    if "server-loss" in st.sections:
        t0 = time.monotonic()
        log("b2. server loss on a 3-node cluster")
        out["server_loss"] = await section_server_loss(st.reps, st.trickle, log)
        print_server_loss(out["server_loss"])
        log(f"b2. took {time.monotonic() - t0:.0f}s")
    if "redelivery" in st.sections:
        t0 = time.monotonic()
        log("b3. re-deliveries per SIGKILL")
        rd_n = int(os.environ.get("BENCH_REDELIVERY_N", "50000" if st.n < 1_000_000 else "200000"))
        out["redelivery"] = await section_redelivery(
            sys.modules[__name__], url, work, st.reps, rd_n
        )
        print_redelivery(out["redelivery"])
        log(f"b3. took {time.monotonic() - t0:.0f}s")
    if "memory" in st.sections:
        t0 = time.monotonic()
        log("c. memory")
        out["memory"] = await section_memory(url, work, st)
        raw = None
        if "throughput" in out:
            raw = med(out["throughput"]["rates"]["raw-ordered"])
        print_memory(out["memory"], raw)
        log(f"c. took {time.monotonic() - t0:.0f}s")
    if "memory-1mb" in st.sections:
        t0 = time.monotonic()
        log("d. memory with 1 MB records")
        out["memory_1mb"] = await section_memory_big(url, work, st)
        print_memory_big(out["memory_1mb"])
        log(f"d. took {time.monotonic() - t0:.0f}s")
    out["elapsed"] = time.monotonic() - t_all
    out["code_at_end"] = code_version()
    c0, c1 = out["code"], out["code_at_end"]
    print(
        f"\ncode: {c0['commit']}{' (dirty)' if c0['dirty'] else ''}, "
        f"worker.py {c0['worker_py_sha256']}"
        + (
            f"; CHANGED during the run to {c1['worker_py_sha256']} (CLI workers started "
            "later run the new file)"
            if c1["worker_py_sha256"] != c0["worker_py_sha256"]
            else ""
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--member"]:  # a child process of section d.
        url, stream, group, progress, bound = args[1:6]
        asyncio.run(_member_main(url, stream, group, progress, int(bound)))
        return 0
    st = Settings.from_args(argv)
    with tempfile.TemporaryDirectory(prefix="wbench-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        with NatsServer(Path(tmp) / "nats") as srv:
            global SERVER_PID
            SERVER_PID = srv.pid  # for the CPU figures of section b3
            log(f"nats-server {srv.url}; sections {sorted(st.sections)}; N={st.n:,}")
            out = asyncio.run(amain(st, srv.url, work))
    dest = Path(".bench")
    dest.mkdir(exist_ok=True)
    (dest / "worker.json").write_text(json.dumps(out, indent=2))
    log(f"done in {out['elapsed']:.0f}s; wrote {dest / 'worker.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
