"""Section a of ``bench/worker_bench.py``: the worker's throughput against nats-py's
ordered consumer and the per-message-ack design."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import worker_common
from nats.js import api
from worker_common import (
    BACKLOG_STREAM,
    CLIENT_ERRORS,
    PARTITIONS,
    PAYLOAD,
    Run,
    Settings,
    connect,
    errors_since,
    log,
    med,
    wait_progress,
)

from airflow_nats_ordered.core.stream.partitioning import (
    partition_subject,
    partition_wildcard,
)
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process and by the run's
    nats-server (0 if unknown)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    server = 0.0
    pid = worker_common.SERVER_PID
    if pid is not None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return r.ru_utime + r.ru_stime, server


#: the last variant's timed window: CPU of this process and of nats-server (seconds), and
#: when its first record was seen (seconds from t0)
WINDOW: dict[str, float] = {}


def _window(c0: tuple[float, float], first: float | None, t0: float) -> None:
    c1 = _cpu()
    WINDOW.update(client=c1[0] - c0[0], server=c1[1] - c0[1])
    WINDOW["first"] = first - t0 if first is not None else float("nan")


async def v_raw_ordered(url: str, prefix: str, n: int, rnd: int) -> Run:
    nc = await connect(url)
    before = Counter(CLIENT_ERRORS)
    count = 0
    first: float | None = None

    async def cb(msg: Any) -> None:
        nonlocal count, first
        if first is None:
            first = time.perf_counter()
        count += 1

    c0 = _cpu()
    t0 = time.perf_counter()
    sub = await nc.jetstream().subscribe(
        partition_wildcard(prefix), stream=BACKLOG_STREAM, ordered_consumer=True, cb=cb
    )
    got, elapsed = await wait_progress(lambda: count, n, t0)
    _window(c0, first, t0)
    await sub.unsubscribe()
    await nc.close()
    return Run(elapsed, got, n, errors_since(before))


WORKER_STATS: list[dict[str, Any]] = []

#: issue 33's goal: the worker (and a batch handler) at least this many times nats-py's raw
#: ordered consumer's rate on the same backlog, in the same run
GOAL = 1.9


async def _worker_run(url: str, n: int, rnd: int, batch: bool) -> Run:
    nc = await connect(url)
    before = Counter(CLIENT_ERRORS)
    count = calls = 0
    high = [0] * PARTITIONS  # count progress, not re-deliveries (after a lost lease, say)
    first: float | None = None

    def one(msg: Any) -> None:
        nonlocal count, calls, first
        if first is None:
            first = time.perf_counter()
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
    c0 = _cpu()
    t0 = time.perf_counter()
    await w.start()
    got, elapsed = await wait_progress(lambda: count, n, t0)
    _window(c0, first, t0)
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
    #: CPU microseconds per record read (this process; nats-server) and the first record's
    #: arrival (seconds after t0), per round; NaN where not measured (ack-pending-1)
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    server_cpu: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, list[float]] = {v: [] for v in variants}
    runs: list[dict[str, Any]] = []
    names = list(variants)
    for rnd in range(st.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        got = {}
        for name in order:
            await asyncio.sleep(0.5)  # let the server settle between variants
            WINDOW.clear()
            run: Run = await variants[name](url, prefix, st.n, rnd)
            per = 1e6 / max(1, run.count)
            cpu[name].append(WINDOW.get("client", float("nan")) * per)
            server_cpu[name].append(WINDOW.get("server", float("nan")) * per)
            first[name].append(WINDOW.get("first", float("nan")))
            got[name] = run.rate
            complete[name] &= run.complete
            runs.append(
                {"variant": name, "round": rnd, "rate": run.rate, "count": run.count}
                | {"target": run.target, "elapsed": run.elapsed, "client_errors": run.errors}
                | {
                    "cpu_us_per_record": cpu[name][-1],
                    "server_cpu_us_per_record": server_cpu[name][-1],
                }
                | {"first_record_s": first[name][-1]}
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
        "cpu_us_per_record": cpu,
        "server_cpu_us_per_record": server_cpu,
        "first_record_s": first,
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
        f"  {'CPU us/rec':>10s} {'server':>7s} {'1st rec':>8s}  read all"
    )
    for name in rates:
        r = ratios[name]
        cpu = [x for x in res.get("cpu_us_per_record", {}).get(name, []) if x == x]
        srv = [x for x in res.get("server_cpu_us_per_record", {}).get(name, []) if x == x]
        first = [x for x in res.get("first_record_s", {}).get(name, []) if x == x]
        costs = f"{med(cpu):>10.2f} {med(srv):>7.2f} {med(first):>7.3f}s" if cpu else f"{'-':>29s}"
        print(
            f"{name:14s} {med(rates[name]):>15,.0f} {med(r):>14.2f} {min(r):>7.2f}..{max(r):<6.2f}"
            f"  {costs}"
            f"  {'yes' if res['complete'][name] else 'NO (stalled; rate up to the stall)'}"
        )
    print(
        "CPU us/rec: this process's CPU (user + system) per record read, in the timed window "
        "(start-up included); server: nats-server's; 1st rec: seconds to the first record"
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
    b = med(ratios["worker-batch"])
    print(
        f"worker = {w:.2f} x raw ordered consumer, same run "
        f"({'meets' if w >= GOAL else 'MISSES'} issue 33's >= {GOAL} x goal); "
        f"batch handler {b:.2f} x ({'meets' if b >= GOAL else 'MISSES'} it)"
    )
