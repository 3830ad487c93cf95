"""The worker pool's guarantees, tested by breaking real worker processes.

Several ``nats-ordered worker`` processes apply keyed messages (per-key sequence numbers in
the payload) through the reference fenced SQLite sink while the test SIGKILLs one member,
makes another stop itself (SIGSTOP) inside its handler, between the worker's lease check and
the sink write, resumes it once a newer owner has fenced the partition (a zombie), starts
new members, and SIGTERMs one. A KV watcher records the lease keys as the server stored them.
Then it checks, over everything published and everything applied:

* every message applied exactly once; per key in publish order with no gaps;
* zero writes accepted with a stale token (sink audit); the resumed zombie attempted a
  write after the newer grant, the sink refused it, and the zombie then stopped that
  partition on its own (no further attempt; its lease released);
* never two owners of a partition at once: the members' own lease windows never overlap,
  and no member's window overlaps another member's lease as the server saw it (the lease
  key's history: server timestamps of its creates, renewals and deletes, plus the TTL);
* each pure join moved at most ceil(P / (N + 1)) partitions, all to the new member;
* the SIGTERM'd member exited 0 after releasing its partitions, and at the end every
  surviving member (the resumed zombie included) exits 0 on SIGTERM; one that hangs has
  its threads and tasks dumped into its log (SIGUSR1/SIGUSR2) for the failure message.

The zombie and server-view checks are plain functions, also run on doctored values (a
sink that let the zombie write, a member whose window outlives its lease) and on a real
run of members whose lease margin is negative, so each is shown able to fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from chaos_handlers import EVENTS_DDL, resume
from locations import TESTS
from nats.js.errors import BucketNotFoundError, NotFoundError

from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.sink.audit import AuditRow, FenceEvent
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.sink.fencing import Verdict
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

PARTITIONS = 8
KEYS = 40
TTL = 2.0
GROUP = "chaos"


def _publish(url: str, stream: str, start: int, n: int) -> None:
    async def go():
        nc = await nats.connect(url)
        if start == 0:
            await provision(nc, StreamSpec(stream, partitions=PARTITIONS))
        async with OrderedPublisher(nc, stream) as pub:
            for g in range(start, start + n):
                k = f"k{g % KEYS}"
                await pub.publish(k, json.dumps({"k": k, "i": g // KEYS}).encode())
        await nc.close()

    asyncio.run(go())


# every member: the package's log at INFO with timestamps (a failure message quotes it);
# with a margin, a member whose lease deadline is send time + TTL - margin
_MEMBER = (
    "import logging, sys\n"
    "from airflow_nats_ordered import cli\n"
    "if {margin!r} is not None:\n"
    "    from airflow_nats_ordered.core.group.store import GroupConfig\n"
    "    GroupConfig.safety_margin = property(lambda self: {margin!r})\n"
    "_setup = cli._setup_logging\n"
    "def _timestamped(verbosity):\n"
    "    _setup(max(verbosity, 1))\n"
    "    for h in logging.getLogger('airflow_nats_ordered').handlers:\n"
    "        h.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))\n"
    "cli._setup_logging = _timestamped\n"
    "sys.exit(cli.main(sys.argv[1:]))\n"
)


def _clock(t: float) -> str:
    """A wall-clock time as the members' logs print it (HH:MM:SS.mmm, local time)."""
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


class Pool:
    def __init__(self, url: str, stream: str, tmp: Path) -> None:
        self.url, self.stream, self.tmp = url, stream, tmp
        self.sink = tmp / "sink.db"
        self.audit = tmp / "leases.jsonl"
        self.procs: dict[str, subprocess.Popen] = {}
        self.pause_files: dict[str, str] = {}  # member -> its CHAOS_PAUSE_FILE

    def start(
        self,
        member: str,
        *,
        handler: str = "chaos_handlers:Recorder",
        margin: float | None = None,
        **env: str,
    ) -> None:
        """Start ``nats-ordered worker`` as ``member``; ``margin`` overrides the lease safety
        margin (GroupConfig.safety_margin) in that process, to make an unsafe member."""
        env = dict(
            os.environ,
            PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            CHAOS_SINK=str(self.sink),
            CHAOS_MEMBER=member,
            CHAOS_DELAY="0.002",
            **env,
        )
        launcher = ["-c", _MEMBER.format(margin=margin)]
        if "CHAOS_PAUSE_FILE" in env:
            self.pause_files[member] = env["CHAOS_PAUSE_FILE"]
        log = open(self.tmp / f"{member}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[member] = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "worker",
                "--stream",
                self.stream,
                "--group",
                GROUP,
                "--handler",
                handler,
                "--member-id",
                member,
                "--lease-ttl",
                str(TTL),
                "--commit-every",
                "50",
                "--commit-interval",
                "0.2",
                "--audit-log",
                str(self.audit),
                "--server",
                self.url,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def signal(self, member: str, sig: int) -> None:
        self.procs[member].send_signal(sig)

    def resume(self, member: str) -> None:
        """Resume a member paused by its CHAOS_PAUSE_FILE (see chaos_handlers)."""
        resume(self.pause_files[member], self.procs[member].pid)

    def applied(self) -> int:
        if not self.sink.exists():
            return 0
        with sqlite3.connect(self.sink, timeout=30) as db:
            return db.execute("SELECT COUNT(*) FROM events").fetchone()[0]

    def audit_events(self) -> list[dict]:
        return [json.loads(line) for line in self.audit.read_text().splitlines() if line]

    def owners(self) -> set[str]:
        if not self.audit.exists():
            return set()
        return {e["member"] for e in self.audit_events() if e["kind"] == "lease"}

    def stop_all(self) -> dict[str, int]:
        codes = {}
        for m, p in self.procs.items():
            if p.poll() is None:
                if m in self.pause_files:
                    self.resume(m)
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for m, p in self.procs.items():
            try:
                codes[m] = p.wait(30)
            except subprocess.TimeoutExpired:
                # a member that does not stop: dump its threads and tasks into its log
                p.send_signal(signal.SIGUSR1)
                p.send_signal(signal.SIGUSR2)
                time.sleep(2.0)
                p.kill()
                codes[m] = p.wait()
        return codes

    def log(self, member: str) -> str:
        return (self.tmp / f"{member}.log").read_text(errors="replace")

    def explain(self, history: LeaseHistory | None = None, tail: int = 12000) -> str:
        """What happened so far, for a failure message: every member's log (its tail),
        the assignments the leaders wrote, and the lease keys as the server stored them."""
        parts = []
        for m, proc in self.procs.items():
            state = "running" if proc.poll() is None else f"exited {proc.returncode}"
            parts.append(f"--- {m} (pid {proc.pid}, {state}) log:\n{self.log(m)[-tail:]}")
        if self.audit.exists():
            for e in self.audit_events():
                if e["kind"] == "assignment":
                    parts.append(f"assignment {json.dumps(e, sort_keys=True)}")
        if history is not None:
            parts.append("lease keys on the server (revision, server time, op, member):")
            parts += [
                f"  p.{u.partition} r{u.revision} {_clock(u.at)} {u.op} {u.member}"
                for u in sorted(list(history.updates), key=lambda u: u.revision)[-300:]
            ]
        return "\n".join(parts)


@dataclass(frozen=True)
class LeaseUpdate:
    """One update of a lease key as the server stored it."""

    partition: int
    member: str | None  # None for a delete or purge
    op: str  # "PUT", "DEL" or "PURGE"
    revision: int
    at: float  # the server's timestamp (wall clock, seconds)


class LeaseHistory:
    """Every update of the group's partition lease keys (``p.<n>``), with the server's
    timestamp and revision, from a KV watcher started before the members.

    The lease bucket keeps one revision per key for one TTL, so the watcher must be live
    while the members run: it waits for the bucket to appear and watches from its start.
    """

    def __init__(self, url: str, stream: str) -> None:
        self.url = url
        self.bucket = GroupConfig(stream, GROUP).lease_bucket
        self.updates: list[LeaseUpdate] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> LeaseHistory:
        self._thread.start()
        return self

    def stop(self) -> list[LeaseUpdate]:
        self._stop.set()
        self._thread.join(30)
        if self._error is not None:
            raise AssertionError(f"the lease watcher failed: {self._error!r}")
        return sorted(self.updates, key=lambda u: u.revision)

    def _run(self) -> None:
        try:
            asyncio.run(self._watch())
        except BaseException as exc:  # reported by stop()
            self._error = exc

    async def _watch(self) -> None:
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            while True:
                try:
                    kv = await js.key_value(self.bucket)
                    break
                except (BucketNotFoundError, NotFoundError):
                    if self._stop.is_set():
                        return
                    await asyncio.sleep(0.01)
            watcher = await kv.watch("p.*", include_history=True)
            while not self._stop.is_set():
                try:
                    e = await watcher.updates(timeout=0.2)
                except TimeoutError:  # nats-py raises its subclass or asyncio.TimeoutError
                    continue
                if e is None:
                    continue
                op = e.operation or "PUT"
                member = json.loads(e.value)["member"] if op == "PUT" else None
                at = e.created.timestamp()
                self.updates.append(LeaseUpdate(int(e.key[2:]), member, op, e.revision, at))
            await watcher.stop()
        finally:
            await nc.close()


Window = tuple[float, float, str, int]  # (from, until, member, token or revision)


def server_lease_windows(updates: list[LeaseUpdate], ttl: float) -> dict[int, list[Window]]:
    """Per partition, who held its lease when, as the server saw it: from a member's first
    write of the key until it deleted the key or, with no renewal, until its last write
    plus the TTL (server-side expiry). The last element is the creating revision."""
    windows: dict[int, list[Window]] = defaultdict(list)
    open_: dict[int, list] = {}  # partition -> [from, last write, member, revision]
    for u in sorted(updates, key=lambda u: u.revision):
        cur = open_.get(u.partition)
        if u.op == "PUT" and cur and cur[2] == u.member and u.at <= cur[1] + ttl:
            cur[1] = u.at  # a renewal
            continue
        if cur:
            end = u.at if u.op != "PUT" else cur[1] + ttl
            windows[u.partition].append((cur[0], min(end, cur[1] + ttl), cur[2], cur[3]))
            del open_[u.partition]
        if u.op == "PUT":
            open_[u.partition] = [u.at, u.at, u.member, u.revision]
    for p, (start, last, member, rev) in open_.items():
        windows[p].append((start, last + ttl, member, rev))
    return windows


def member_lease_windows(leases: list[dict]) -> dict[int, list[Window]]:
    """Per partition, when each member believed it held the lease (the worker's audit log:
    confirmed claim or renewal until its own deadline, cut at the release)."""
    windows: dict[tuple[int, str, int], list[float]] = {}
    for e in leases:
        if e["kind"] == "lease":
            key = (e["partition"], e["member"], e["token"])
            w = windows.setdefault(key, [e["valid_from"], e["valid_until"]])
            w[0], w[1] = min(w[0], e["valid_from"]), max(w[1], e["valid_until"])
        elif e["kind"] == "released":
            key = (e["partition"], e["member"], e["token"])
            if key in windows:
                windows[key][1] = min(windows[key][1], e["at"])
    by_part: dict[int, list[Window]] = defaultdict(list)
    for (p, member, token), (a, b) in windows.items():
        by_part[p].append((a, b, member, token))
    return by_part


def member_window_overlaps(member_windows: dict[int, list[Window]]) -> list[str]:
    """Pairs of members whose own windows for a partition overlap, or whose tokens did not
    grow from one owner to the next."""
    problems = []
    for p, ws in member_windows.items():
        ws = sorted(ws)
        for (_a1, b1, m1, t1), (a2, _b2, m2, t2) in zip(ws, ws[1:], strict=False):
            if b1 > a2 and m1 != m2:
                problems.append(
                    f"partition {p}: {m1} (token {t1}) valid until {b1:.3f} overlaps "
                    f"{m2} (token {t2}) from {a2:.3f}"
                )
            if t2 <= t1:
                problems.append(f"partition {p}: token did not grow ({t1} -> {t2})")
    return problems


def server_view_overlaps(
    member_windows: dict[int, list[Window]], server_windows: dict[int, list[Window]]
) -> list[str]:
    """Each time a member believed it held a partition while the server had given that
    partition's lease to another member."""
    problems = []
    for p, mine in member_windows.items():
        for a, b, member, token in mine:
            for sa, sb, holder, rev in server_windows.get(p, []):
                if holder != member and a < sb and sa < b:
                    problems.append(
                        f"partition {p}: {member} (token {token}) believed it held the lease "
                        f"{a:.3f}-{b:.3f} while the server had given it to {holder} "
                        f"(revision {rev}) {sa:.3f}-{sb:.3f}: {min(b, sb) - max(a, sa):.3f}s "
                        "of overlap"
                    )
    return problems


def zombie_problems(
    audit: list[AuditRow],
    fences: list[FenceEvent],
    pid: int,
    partition: int,
    token: int,
    resumed_at: float,
    stopped_first: bool = False,
) -> list[str]:
    """What is wrong with a zombie's behaviour after it resumed (empty if nothing): it must
    have attempted a write of ``partition`` with its old ``token`` after a newer grant
    reached the sink, the sink must have refused it (STALE_TOKEN), and it must then have
    stopped on its own (no further attempt with that token).

    ``stopped_first``: the resumed member found the lease expired before its handler went
    on (its log says so) and cancelled the handler: no write at all is then also right (the
    worker's own lease check pre-empted the sink's fencing, which is tested then by
    nothing but the plain-values tests). Which comes first after SIGCONT is up to the
    scheduler (the quiet fresh-clone CI run of 2026-11-25 saw the lease check first)."""
    mine = [
        r
        for r in audit
        if r.pid == pid and r.partition == partition and r.token == token
        if r.applied_at >= resumed_at
    ]
    if not mine:
        if stopped_first:
            return []
        return [
            f"the zombie (pid {pid}) attempted no write of partition {partition} after it "
            f"resumed at {resumed_at:.3f}"
        ]
    first = mine[0]
    newer = [f for f in fences if f.partition == partition and f.token > token and f.id < first.id]
    problems = []
    if not newer:
        problems.append(
            f"no newer grant of partition {partition} reached the sink before the "
            f"zombie's write {first}"
        )
    if first.verdict is not Verdict.STALE_TOKEN:
        problems.append(f"the sink did not refuse the zombie's stale write: {first}")
    if len(mine) > 1:
        problems.append(f"the zombie kept writing with token {token} after the refusal: {mine[1:]}")
    return problems


def _wait(cond, timeout: float, what: str, explain=None) -> None:
    """Wait until ``cond()``; after ``timeout`` seconds fail, with ``explain()`` (what the
    members logged and the server recorded) in the message, so a hang explains itself."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            detail = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"timed out waiting for {what} after {timeout:g}s{detail}")
        time.sleep(0.1)


@pytest.mark.chaos
def test_kill_pause_join_and_leave_keep_order_fencing_and_exclusive_ownership(
    nats_server, unique_name, tmp_path
):
    first, second = 4000, 2000
    _publish(nats_server.url, unique_name, 0, first)
    sink = FencedSqliteSink(tmp_path / "sink.db", stream=unique_name, group=GROUP)
    with sqlite3.connect(tmp_path / "sink.db") as db:
        db.execute(EVENTS_DDL)
    pool = Pool(nats_server.url, unique_name, tmp_path)
    history = LeaseHistory(nats_server.url, unique_name).start()  # before any member
    pause = tmp_path / "pause-w2"
    try:
        for m in ("w1", "w2", "w3"):
            pool.start(m, **({"CHAOS_PAUSE_FILE": str(pause)} if m == "w2" else {}))
        _wait(lambda: pool.owners() >= {"w1", "w2", "w3"}, 30, "three members owning")
        _wait(lambda: pool.applied() > 300, 30, "processing to start")

        pool.signal("w1", signal.SIGKILL)  # a crash: its partitions move after the TTL
        time.sleep(1.0)
        # w2 stops itself inside its handler, past the worker's lease check, before the sink
        # write (a GC or VM pause at the worst moment); it holds no sink transaction
        pause.touch()
        paused = Path(f"{pause}.paused")
        _wait(paused.exists, 30, "w2 to pause inside its handler")
        time.sleep(0.1)  # the file is written just before the SIGSTOP
        in_hand = json.loads(paused.read_text())
        zp, zt = in_hand["partition"], in_hand["token"]
        _wait(
            lambda: any(f.token > zt for f in sink.fence_log(zp)),
            30,
            f"a newer owner to fence partition {zp} while w2 is stopped",
            explain=lambda: pool.explain(history),
        )
        # taken before SIGCONT: the zombie may run (and write) before this process does again
        resumed_at = time.time()
        pool.resume("w2")  # wakes believing it still owns its partitions
        pool.start("w4")  # joins
        _wait(lambda: "w4" in pool.owners(), 30, "w4 to own partitions")
        pool.start("w5")
        _wait(lambda: "w5" in pool.owners(), 30, "w5 to own partitions")
        _publish(nats_server.url, unique_name, first, second)
        time.sleep(1.0)
        sigterm_at = time.time()
        pool.signal("w3", signal.SIGTERM)  # graceful leave
        w3_code = pool.procs["w3"].wait(30)
        _wait(lambda: pool.applied() >= first + second, 120, "the group to drain")
        time.sleep(0.5)
    finally:
        codes = pool.stop_all()
        updates = history.stop()

    total = first + second
    with sqlite3.connect(tmp_path / "sink.db") as db:
        rows = db.execute("SELECT k, i, partition, seq, token, member FROM events ORDER BY id")
        events = rows.fetchall()
    audit = sink.audit()
    fences = sink.fence_log()
    leases = pool.audit_events()

    # 1. every message applied exactly once, per key in publish order without gaps
    assert len(events) == total, f"{len(events)} applied, {total} published"
    per_key = defaultdict(list)
    for k, i, *_ in events:
        per_key[k].append(i)
    assert len(per_key) == KEYS
    for k, seq in per_key.items():
        assert seq == list(range(len(seq))), f"key {k} out of order or with gaps"

    # 2. zero writes accepted with a stale token
    highest: dict[int, int] = defaultdict(int)
    merged = sorted(
        [(a.id, "apply", a) for a in audit] + [(f.id, "fence", f) for f in fences],
        key=lambda x: x[0],
    )
    for _, kind, row in merged:
        if kind == "fence":
            highest[row.partition] = max(highest[row.partition], row.token)
        elif row.verdict is Verdict.APPLY:
            assert row.token >= highest[row.partition], f"stale write applied: {row}"
            highest[row.partition] = row.token
    #    the resumed zombie tried to write after the newer grant, was refused, and stopped
    #    that partition on its own: no further attempt, and its worker released it
    w2_pid = pool.procs["w2"].pid
    w2_log = pool.log("w2")
    stopped_first = any(
        f"lease {what} expired locally" in w2_log for what in (f"p.{zp}", f"of partition {zp}")
    )
    assert zombie_problems(audit, fences, w2_pid, zp, zt, resumed_at, stopped_first) == [], w2_log
    attempted = any(
        r.pid == w2_pid and r.partition == zp and r.token == zt and r.applied_at >= resumed_at
        for r in audit
    )
    print(
        f"\nzombie w2 on partition {zp}: "
        + ("its stale write refused by the sink" if attempted else "stopped by its lease check")
    )
    gave_up = [
        e
        for e in leases
        if e["kind"] == "released"
        and (e["member"], e["partition"], e["token"]) == ("w2", zp, zt)
        and e["at"] >= resumed_at
    ]
    assert gave_up, f"w2 did not stop partition {zp} (token {zt}) after the refusal"
    tokens_by_part = defaultdict(set)
    for *_, p, _seq, tok, _m in [(None, None, *e[2:]) for e in events]:
        tokens_by_part[p].add(tok)
    assert any(len(t) > 1 for t in tokens_by_part.values()), "no partition changed owner"

    # 3. never two owners of a partition at once: the members' own lease windows never
    #    overlap, nor does any member's window overlap another member's lease as the server
    #    saw it (the windows are in wall-clock time; server and members share this host)
    mine = member_lease_windows(leases)
    assert member_window_overlaps(mine) == []
    on_server = server_lease_windows(updates, TTL)
    assert set(on_server) == set(range(PARTITIONS)), f"lease history incomplete: {on_server}"
    assert any(len({w[2] for w in ws}) > 1 for ws in on_server.values()), on_server
    assert server_view_overlaps(mine, on_server) == []

    # 4. each pure join moved at most ceil(P / (N + 1)) partitions, all to the newcomer
    assignments = [e for e in leases if e["kind"] == "assignment"]
    pure_joins = 0
    for before, after in zip(assignments, assignments[1:], strict=False):
        old, new = set(before["members"]), set(after["members"])
        if old and new > old and len(new - old) == 1:
            (joiner,) = new - old
            moved = {p for p, m in after["owners"].items() if before["owners"].get(p) != m}
            assert len(moved) <= math.ceil(PARTITIONS / (len(old) + 1)), after
            assert all(after["owners"][p] == joiner for p in moved), after
            pure_joins += 1
    assert pure_joins >= 1, f"no pure join observed in {assignments}"

    # 5. the SIGTERM'd member left gracefully
    assert w3_code == 0, pool.log("w3")
    released = [
        e
        for e in leases
        if e["kind"] == "released" and e["member"] == "w3" and e["at"] >= sigterm_at
    ]
    assert released and all(e["graceful"] for e in released), released
    assert codes["w1"] == -signal.SIGKILL
    # 6. the others, the resumed zombie included, leave gracefully on SIGTERM too
    for m in ("w2", "w4", "w5"):
        assert codes[m] == 0, f"{m} exited {codes[m]}:\n{pool.log(m)[-6000:]}"


# -- the checks can fail: doctored values and an unsafe member -------------------------------

A, S = Verdict.APPLY, Verdict.STALE_TOKEN


def _row(id_: int, token: int, seq: int, verdict: Verdict, at: float, pid: int = 7) -> AuditRow:
    return AuditRow(id_, 0, token, seq, verdict, at, pid)


def test_zombie_check_fires_when_the_sink_lets_the_zombie_write_or_it_keeps_trying() -> None:
    newer = [FenceEvent(2, 0, 5, 5, 10.0, 8)]
    refused = [_row(3, 4, 9, S, 11.0)]
    assert zombie_problems(refused, newer, 7, 0, 4, 10.5) == []  # what the chaos run asserts
    # a sink with fencing disabled: the zombie's write after the newer grant is applied
    assert "did not refuse" in zombie_problems([_row(3, 4, 9, A, 11.0)], newer, 7, 0, 4, 10.5)[0]
    # refused, but the zombie kept going with its old token
    kept = refused + [_row(4, 4, 10, S, 11.1)]
    assert "kept writing" in zombie_problems(kept, newer, 7, 0, 4, 10.5)[0]
    # it never tried after resuming (the old assertion's blind spot), or before any newer grant
    assert "attempted no write" in zombie_problems([_row(1, 4, 8, A, 9.0)], newer, 7, 0, 4, 10.5)[0]
    # no write is right only when the member stopped the partition on its own lease check
    assert zombie_problems([_row(1, 4, 8, A, 9.0)], newer, 7, 0, 4, 10.5, stopped_first=True) == []
    early = [FenceEvent(5, 0, 5, 5, 12.0, 8)]
    assert "no newer grant" in zombie_problems(refused, early, 7, 0, 4, 10.5)[0]


def test_server_view_check_fires_when_a_member_outlives_its_lease_on_the_server() -> None:
    ttl = 2.0
    updates = [  # w1 claims p0 at 100, renews at 100.5, stops; w2 claims at 102.7
        LeaseUpdate(0, "w1", "PUT", 1, 100.0),
        LeaseUpdate(0, "w1", "PUT", 2, 100.5),
        LeaseUpdate(0, "w2", "PUT", 3, 102.7),
        LeaseUpdate(0, None, "DEL", 4, 104.0),
    ]
    server = server_lease_windows(updates, ttl)
    assert server == {0: [(100.0, 102.5, "w1", 1), (102.7, 104.0, "w2", 3)]}
    safe = {0: [(100.01, 100.5 + ttl - 0.4, "w1", 1), (102.71, 103.9, "w2", 2)]}
    assert server_view_overlaps(safe, server) == []
    # w1's own deadline with a margin of -1 s: it believes it holds p0 until 103.5
    unsafe = {0: [(100.01, 100.5 + ttl + 1.0, "w1", 1), (102.71, 103.9, "w2", 2)]}
    (problem,) = server_view_overlaps(unsafe, server)
    assert "w1 (token 1) believed it held the lease" in problem and "given it to w2" in problem


@pytest.mark.chaos
@pytest.mark.parametrize("margin, safe", [(None, True), (-3.0, False)])
def test_server_view_check_catches_a_member_whose_lease_margin_is_negative(
    nats_server, unique_name, tmp_path, margin, safe
):
    """A negative control on real processes: member u (lease deadline = send time + TTL -
    ``margin``) owns a partition and is paused; v, already a member, takes it over once the
    server expired u's lease. With the default margin the check passes; with a negative
    one, u believes in its lease after the server has given it to v, and the check must say
    so. (A margin of 0 is not enough to see it on one host: the server cannot hand the lease
    over before the last renewal's arrival + TTL, which is after its send time + TTL.)"""

    async def make_stream() -> None:
        nc = await nats.connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await nc.close()

    asyncio.run(make_stream())
    pool = Pool(nats_server.url, unique_name, tmp_path)
    history = LeaseHistory(nats_server.url, unique_name).start()

    def held_by(member: str) -> set[int]:
        if not pool.audit.exists():
            return set()
        events = pool.audit_events()
        return {e["partition"] for e in events if e["kind"] == "lease" and e["member"] == member}

    try:
        pool.start("u", handler="chaos_handlers:ignore", margin=margin)
        _wait(lambda: held_by("u") == {0, 1}, 30, "u to own both partitions")
        pool.start("v", handler="chaos_handlers:ignore")  # live, so it claims without delay
        _wait(lambda: held_by("v"), 30, "v to join and own a partition")
        pool.signal("u", signal.SIGSTOP)
        _wait(lambda: held_by("v") == {0, 1}, 30, "v to take both partitions over")
        time.sleep(0.5)
    finally:
        pool.stop_all()
        updates = history.stop()
    problems = server_view_overlaps(
        member_lease_windows(pool.audit_events()), server_lease_windows(updates, TTL)
    )
    if safe:
        assert problems == []
    else:
        assert any("u (token" in p and "given it to v" in p for p in problems), problems


# -- the zombie's pause itself ------------------------------------------------------------------


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.chaos
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, pins CPUs")
def test_a_paused_member_leaves_the_sink_writable_for_the_others(tmp_path):
    """The chaos test's zombie pauses with no sink transaction open, although its other
    partitions keep writing from other threads: while it is stopped, another process takes
    the sink's write lock at once. Without this, the paused member held SQLite's write lock
    for the whole pause (it was stopped inside another partition's COMMIT), no newer owner
    could fence its partition, and the chaos test timed out waiting for one.

    The writer runs on one CPU with its main thread at the lowest priority, as on a loaded
    machine: there a process-directed SIGSTOP (taken by the main thread) used to land only
    after the pausing thread had released the sink and another thread had begun writing."""
    sink_path = tmp_path / "sink.db"
    FencedSqliteSink(sink_path, stream="S", group=GROUP).close()
    with sqlite3.connect(sink_path) as db:
        db.execute(EVENTS_DDL)
    pause = tmp_path / "pause"
    env = dict(
        os.environ,
        PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        CHAOS_SINK=str(sink_path),
        CHAOS_STREAM="S",
        CHAOS_GROUP=GROUP,
        CHAOS_PAUSE_FILE=str(pause),
    )
    cpu = min(os.sched_getaffinity(0))
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from chaos_handlers import write_forever; write_forever(4, slow_main=True)",
        ],
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )

    def applied() -> int:
        with contextlib.closing(sqlite3.connect(sink_path, timeout=30)) as db:
            return db.execute("SELECT COUNT(*) FROM events").fetchone()[0]

    held = []
    try:
        for cycle in range(12):
            before = applied()
            _wait(lambda b=before: applied() > b + 20, 60, "the writer to write")
            for marker in (f"{pause}.paused", f"{pause}.resume"):  # the last pause's
                Path(marker).unlink(missing_ok=True)
            pause.touch()
            _wait(Path(f"{pause}.paused").exists, 30, "the writer to pause")
            _wait(lambda: _proc_state(writer.pid) == "T", 30, "the writer to be stopped")
            # nobody else writes: a free lock is taken at once, one held by the stopped
            # writer never is (the timeout only bounds the attempt)
            with contextlib.closing(
                sqlite3.connect(sink_path, timeout=5, isolation_level=None)
            ) as db:
                try:
                    db.execute("BEGIN IMMEDIATE")
                    db.execute("ROLLBACK")
                except sqlite3.OperationalError as exc:
                    held.append(f"pause {cycle}: {exc}")
            resume(str(pause), writer.pid)
    finally:
        writer.send_signal(signal.SIGCONT)
        writer.kill()
        writer.wait()
    assert held == [], f"the paused writer held the sink's write lock: {held}"
