"""Section ``redelivery`` of ``bench/worker_bench.py``: what a SIGKILL of a busy member costs.

Two CLI worker processes (``bench_handlers:Recorder``, lease TTL 2 s) drain a backlog of
BENCH_REDELIVERY_N (default 200,000) 100-byte records over 16 partitions with a fresh group;
when a third of it is applied, one member is SIGKILLed; the survivor takes its partitions
over after the TTL and the drain completes. Per variant (commit settings), interleaved over
BENCH_FAILOVER_REPS rounds:

  re-deliveries  applies of a (partition, seq) already applied: what the killed member had
                 applied but not committed (the uncommitted tail a SIGKILL re-delivers)
  rate           both members' applies per second before the kill (the drain's throughput)
  commit writes  writes to the group's state bucket per second over the same window

``old-cadence`` (``--commit-every 1000 --commit-interval 1``, the defaults before issue 19)
is the same-run baseline for the rate; the goal was <= 100 re-deliveries at the same rate.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

VARIANTS: dict[str, list[str]] = {
    "old-cadence": ["--commit-every", "1000", "--commit-interval", "1"],
    "every-100": ["--commit-every", "100", "--commit-interval", "0.1"],
    "every-25": ["--commit-every", "25", "--commit-interval", "0.025"],
    "every-5": ["--commit-every", "5", "--commit-interval", "0.005"],
}


def _read_applies(path: Path) -> list[tuple[float, str, int, int]]:
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        t, member, p, seq = line.split()
        out.append((float(t), member, int(p), int(seq)))
    return out


async def _state_writes(nc: Any, bucket: str) -> int:
    try:
        info = await nc.jetstream().stream_info(f"KV_{bucket}")
    except Exception:  # noqa: BLE001 - the bucket is created by the first member
        return 0
    return int(info.state.last_seq or 0)


async def one_run(
    wb: Any, url: str, work: Path, stream: str, n: int, extra: list[str]
) -> dict[str, Any]:
    from airflow_nats_ordered.core.group_config import GroupConfig

    group = f"rd-{uuid.uuid4().hex[:6]}"
    bucket = GroupConfig(stream, group).state_bucket
    apply_log = work / f"{group}.apply"
    env = {"BENCH_APPLY_LOG": str(apply_log)}
    nc = await wb.connect(url)
    members = [_spawn(wb, url, work, stream, group, f"{group}-m{i}", env, extra) for i in range(2)]
    victim = members[0]
    t_start = None
    w0 = 0
    killed_at = None
    result: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            applies = _read_applies(apply_log)
            if t_start is None and applies:
                t_start, w0 = time.time(), await _state_writes(nc, bucket)
                a0 = len(applies)
            if killed_at is None and len(applies) >= n // 3 and t_start is not None:
                w1 = await _state_writes(nc, bucket)
                t1 = time.time()
                a1 = len(applies)
                victim.proc.send_signal(signal.SIGKILL)
                killed_at = t1
                result["rate"] = (a1 - a0) / (t1 - t_start)
                result["commit_writes_per_s"] = (w1 - w0) / (t1 - t_start)
            if killed_at is not None:
                seen = {(p, s) for _, _, p, s in applies}
                if len(seen) >= n:
                    result["redeliveries"] = len(applies) - len(seen)
                    result["takeover_s"] = (
                        min(
                            (t for t, m, _, _ in applies if t > killed_at and m != victim.name),
                            default=killed_at,
                        )
                        - killed_at
                    )
                    break
        else:
            result["incomplete"] = True
    finally:
        for m in members:
            wb.stop_member(m, signal.SIGTERM if m is not victim else signal.SIGKILL)
        await nc.close()
    return result


def _spawn(
    wb: Any,
    url: str,
    work: Path,
    stream: str,
    group: str,
    name: str,
    env: dict[str, str],
    extra: list[str],
) -> Any:
    """worker_bench.spawn_member, with the variant's extra CLI flags."""
    import subprocess

    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(wb.BENCH_DIR), full.get("PYTHONPATH", "")) if p
    )
    full["BENCH_MEMBER"] = name
    full.update(env)
    cmd = wb.cli_path() + [
        "worker",
        "--stream",
        stream,
        "--group",
        group,
        "--handler",
        "bench_handlers:Recorder",
        "--member-id",
        name,
        "--lease-ttl",
        f"{wb.TTL:g}",
        "--server",
        url,
        *extra,
    ]
    err = work / f"{name}.stderr"
    with err.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=wb._pdeathsig(),
        )
    return wb.Member(name, proc, err, time.time())


async def section_redelivery(wb: Any, url: str, work: Path, reps: int, n: int) -> dict[str, Any]:
    stream = "WREDELIVER"
    nc = await wb.connect(url)
    await wb.publish_backlog(nc, stream, n)
    await nc.close()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for r in range(reps):
        for v in order[r % len(order) :] + order[: r % len(order)]:
            res = await one_run(wb, url, work, stream, n, VARIANTS[v])
            runs[v].append(res)
            wb.log(f"  redelivery {v}: {res}")
    return {"n": n, "runs": runs}


def print_redelivery(res: dict[str, Any]) -> None:
    runs = res["runs"]
    print(f"\n== re-deliveries per SIGKILL of a busy member ({res['n']:,} records, 2 members) ==")
    base = [r["rate"] for r in runs.get("old-cadence", []) if "rate" in r]
    print(
        f"{'variant':<14}{'re-deliveries':>15}{'rate msg/s':>12}{'x old':>8}{'commit writes/s':>17}"
    )
    for v, rs in runs.items():
        red = [r["redeliveries"] for r in rs if "redeliveries" in r]
        rate = [r["rate"] for r in rs if "rate" in r]
        cw = [r["commit_writes_per_s"] for r in rs if "commit_writes_per_s" in r]
        ratio = [a / b for a, b in zip(rate, base, strict=False) if b]
        print(
            f"{v:<14}{_m(red):>15}{_m(rate):>12}{_m(ratio, 2):>8}{_m(cw):>17}"
            + (f"   (each: {red})" if len(red) > 1 else "")
        )
    print("goal: <= 100 re-deliveries per SIGKILL at the same rate (x old ~ 1)")


def _m(xs: list[float], digits: int = 0) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):,.{digits}f}"
