"""Section b of ``bench/worker_bench.py``: SIGKILL and SIGTERM failover and join settling,
with worker processes started through the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_common import (
    FAILOVER_STREAM,
    PARTITIONS,
    PAYLOAD,
    TTL,
    Member,
    Settings,
    connect,
    log,
    med,
    reap,
    spawn_member,
    stop_member,
    trouble,
)

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import (
    partition_for,
)

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
