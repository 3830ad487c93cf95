"""Section ``redelivery`` of ``bench/worker_bench.py``: what a SIGKILL of a busy member costs.

Two CLI worker processes (``bench_handlers:Recorder``, lease TTL 2 s) drain a backlog of
BENCH_REDELIVERY_N (default 200,000) 100-byte records over 16 partitions with a fresh group;
when 40 % of it is applied, one member is SIGKILLed; the survivor takes its partitions
over after the TTL and the drain completes. Per variant (commit settings), interleaved over
BENCH_FAILOVER_REPS rounds (BENCH_REDELIVERY_VARIANTS picks variants):

  re-deliveries  applies of a (partition, seq) already applied: what the killed member had
                 applied but not committed (the uncommitted tail a SIGKILL re-delivers)
  rate           both members' applies per second from 10 % of the records to the kill,
                 from the apply log's timestamps (the drain's steady throughput)
  x old          the rate over ``old-cadence``'s in the same round
  commit writes  writes to the group's state bucket per second over the same window
  CPU/record     CPU time of both members (and of nats-server) per record applied over the
                 same window (/proc): steadier than rates on a shared machine
  takeover       from the kill to the survivor's first apply of a partition the victim had

``old-cadence`` (``--commit-every 1000 --commit-interval 1``, the defaults before issue 19)
is the same-run baseline for the rate; ``default`` runs without commit flags (the CLI's
defaults). The goal: <= 100 re-deliveries at the same rate.
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
    "default": [],
    "every-100": ["--commit-every", "100", "--commit-interval", "0.1"],
    "every-25": ["--commit-every", "25", "--commit-interval", "0.025"],
    "every-5": ["--commit-every", "5", "--commit-interval", "0.005"],
}
#: the variants run unless BENCH_REDELIVERY_VARIANTS (a comma list of VARIANTS) names others
DEFAULT_VARIANTS = "old-cadence,default,every-100"


class ApplyLog:
    """The Recorder's apply log, read incrementally (the bench shares the cores with the
    members it measures, so it does not parse the whole file again at every poll)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.applies: list[tuple[float, str, int, int]] = []

    def read(self) -> list[tuple[float, str, int, int]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.applies
        self.offset += len(chunk)
        *lines, self.rest = (self.rest + chunk).split(b"\n")
        for line in lines:
            t, member, p, seq = line.split()
            self.applies.append((float(t), member.decode(), int(p), int(seq)))
        return self.applies


async def _state_writes(nc: Any, bucket: str) -> int:
    try:
        info = await nc.jetstream().stream_info(f"KV_{bucket}")
    except Exception:  # noqa: BLE001 - the bucket is created by the first member
        return 0
    return int(info.state.last_seq or 0)


async def one_run(
    wb: Any, url: str, work: Path, stream: str, n: int, extra: list[str]
) -> dict[str, Any]:
    """One drain with a SIGKILL at KILL_AT of it. The rate is taken from the apply log's own
    timestamps over the steady window (from RATE_FROM of the records applied to the kill),
    so neither the members' start-up nor the bench's polling is in it."""
    from airflow_nats_ordered.core.group.config import GroupConfig

    group = f"rd-{uuid.uuid4().hex[:6]}"
    bucket = GroupConfig(stream, group).state_bucket
    apply_log = work / f"{group}.apply"
    env = {"BENCH_APPLY_LOG": str(apply_log)}
    nc = await wb.connect(url)
    members = [
        wb.spawn_member(
            url, work, stream, group, f"{group}-m{i}", "bench_handlers:Recorder", env, extra=extra
        )
        for i in range(2)
    ]
    victim = members[0]
    log_ = ApplyLog(apply_log)
    w0: tuple[float, int] | None = None
    killed_at = None
    result: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            applies = log_.read()
            if w0 is None and len(applies) >= n * RATE_FROM:
                w0 = (time.time(), await _state_writes(nc, bucket))
                c0 = (_cpu(members), _cpu_of(getattr(wb, "SERVER_PID", None)), len(applies))
            if killed_at is None and w0 is not None and len(applies) >= n * KILL_AT:
                w1 = await _state_writes(nc, bucket)
                c1 = (_cpu(members), _cpu_of(getattr(wb, "SERVER_PID", None)), len(applies))
                victim.proc.send_signal(signal.SIGKILL)
                killed_at = time.time()
                result["commit_writes_per_s"] = (w1 - w0[1]) / (killed_at - w0[0])
                done = max(1, c1[2] - c0[2])
                result["member_cpu_us"] = (c1[0] - c0[0]) / done * 1e6
                if c0[1] is not None and c1[1] is not None:
                    result["server_cpu_us"] = (c1[1] - c0[1]) / done * 1e6
            if killed_at is not None:
                seen = {(p, s) for _, _, p, s in applies}
                if len(seen) >= n:
                    result.update(_figures(applies, victim.name, killed_at, n))
                    break
        else:
            result["incomplete"] = True
    finally:
        for m in members:
            wb.stop_member(m, signal.SIGTERM if m is not victim else signal.SIGKILL)
        await nc.close()
    return result


def _cpu_of(pid: int | None) -> float | None:
    """CPU seconds (user + system) process ``pid`` used so far; None if it is gone."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(members: list[Any]) -> float:
    return sum(_cpu_of(m.proc.pid) or 0.0 for m in members)


#: the rate window starts when this share of the records is applied; the kill comes at KILL_AT
RATE_FROM = 0.1
KILL_AT = 0.4


def _figures(
    applies: list[tuple[float, str, int, int]], victim: str, killed_at: float, n: int
) -> dict[str, Any]:
    """Re-deliveries, the steady rate before the kill, and when the survivor first applied
    one of the victim's partitions."""
    seen = {(p, s) for _, _, p, s in applies}
    before = sorted(t for t, _, _, _ in applies if t <= killed_at)
    t0 = before[int(n * RATE_FROM)] if len(before) > n * RATE_FROM else before[0]
    last = before[-1]
    in_window = sum(1 for t in before if t >= t0)
    victims = {p for t, m, p, _ in applies if m == victim and t <= killed_at}
    taken = [t for t, m, p, _ in applies if m != victim and t > killed_at and p in victims]
    return {
        "redeliveries": len(applies) - len(seen),
        "rate": in_window / (last - t0) if last > t0 else 0.0,
        "victim_partitions": len(victims),
        "takeover_s": (min(taken) - killed_at) if taken else None,
    }


async def section_redelivery(wb: Any, url: str, work: Path, reps: int, n: int) -> dict[str, Any]:
    stream = "WREDELIVER"
    nc = await wb.connect(url)
    await wb.publish_backlog(nc, stream, n)
    await nc.close()
    order = os.environ.get("BENCH_REDELIVERY_VARIANTS", DEFAULT_VARIANTS).split(",")
    unknown = sorted(set(order) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"BENCH_REDELIVERY_VARIANTS: unknown {unknown}; known: {list(VARIANTS)}")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in order}
    for r in range(reps):
        for v in order[r % len(order) :] + order[: r % len(order)]:
            res = await one_run(wb, url, work, stream, n, VARIANTS[v])
            runs[v].append(res)
            wb.log(f"  redelivery {v}: {res}")
    return {"n": n, "runs": runs}


def print_redelivery(res: dict[str, Any]) -> None:
    runs = res["runs"]
    print(f"\n== re-deliveries per SIGKILL of a busy member ({res['n']:,} records, 2 members) ==")
    base = [r.get("rate") for r in runs.get("old-cadence", [])]
    print(
        f"{'variant':<14}{'re-deliveries (min..max)':>26}{'rate msg/s':>12}{'x old':>8}"
        f"{'commit writes/s':>17}{'member CPU/rec':>16}{'server CPU/rec':>16}{'takeover s':>12}"
    )
    for v, rs in runs.items():
        red = [r["redeliveries"] for r in rs if "redeliveries" in r]
        rate = [r["rate"] for r in rs if "rate" in r]
        cw = [r["commit_writes_per_s"] for r in rs if "commit_writes_per_s" in r]
        tk = [r["takeover_s"] for r in rs if r.get("takeover_s") is not None]
        mc = [r["member_cpu_us"] for r in rs if "member_cpu_us" in r]
        sc = [r["server_cpu_us"] for r in rs if "server_cpu_us" in r]
        # the ratio of each round's rate to the baseline's in the same round
        ratio = [r["rate"] / b for r, b in zip(rs, base, strict=False) if b and "rate" in r]
        span = f"{_m(red)} ({min(red)}..{max(red)})" if red else "n/a"
        print(
            f"{v:<14}{span:>26}{_m(rate):>12}{_m(ratio, 2):>8}{_m(cw):>17}"
            f"{_m(mc, 1) + ' us':>16}{_m(sc, 1) + ' us':>16}{_m(tk, 2):>12}"
            + (f"   (each: {red})" if len(red) > 1 else "")
        )
    print(
        "goal: <= 100 re-deliveries per SIGKILL at the same rate (x old ~ 1); rate: both "
        f"members' applies/s from {RATE_FROM:.0%} of the records to the kill at {KILL_AT:.0%}"
    )


def _m(xs: list[float], digits: int = 0) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):,.{digits}f}"
