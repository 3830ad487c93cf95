"""One exploration: a system under test, the generator and the nemesis at work, then the
final phase and the checker.

The system: a real nats-server (or a 3-node cluster) from ``airflow_nats_ordered.embedded.servers``,
a partitioned stream, a consumer group whose members apply every record through the fenced
SQLite sink (``explore.handlers``), and every operation as a real process (``nats-ordered``
commands, ``publish_run`` in ``explore.publish_run_child``).

The run has two phases. *Chaos* (``seconds`` long): every tick the nemesis may inject a
fault and the generator may start an operation; ended commands are noted, and every
liveness problem (a command past its deadline, a process spinning) is recorded at once.
*Final*: faults stop, paused processes resume, one-shot commands end, inputs left partial
are published again, a member makes sure the group drains (twice, around a replay of the
dead letters), then every member leaves and one more input is published, so the lag the
group reports can be compared with the records really left to apply. Then the stream, the
dead letters and the sink are read back and :func:`explore.checker.check` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.core.stream.repartition import CRASH_ENV, CRASH_POINTS, interrupted
from airflow_nats_ordered.embedded.servers import NatsCluster, NatsServer

from .checker import (
    AppliedRecord,
    DrainClaim,
    Facts,
    GlobalStored,
    Handover,
    LagClaim,
    MemberExit,
    PublishReport,
    ReaderRun,
    StoredRecord,
    Violation,
    check,
)
from .generator import GLOBAL_OPS, NOT_GLOBAL, OPERATIONS, Action, Generator
from .history import Command, History
from .known import SKIPPED_INVARIANTS
from .nemesis import FAULTS, Fault, Nemesis
from .privilege import (
    CHECKER_NAME,
    OP_USERS,
    Accounts,
    client_denials,
    connections,
    server_violations,
    wrong_users,
)
from .processes import Processes, Running, _descendants
from .world import Producer, World

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from chaos_handlers import EVENTS_DDL  # noqa: E402
from streamcheck import read_stream  # noqa: E402

from .handlers import HANDOVERS_DDL  # noqa: E402  (imports chaos_handlers, from tests/)

STREAM = "EXPLORE"
GROUP = "g"
HANDLER = "explore.handlers:PoisonRecorder"
#: --global-order: the global-order readers' group and handler
GLOBAL_GROUP = "gg"
GLOBAL_HANDLER = "explore.handlers:GlobalRecorder"
#: what a global-order reader prints once it took its position (cli/global_read.py)
RESUMING = "resuming after global sequence "
CLI = [sys.executable, "-m", "airflow_nats_ordered.cli"]
#: deadlines: generous bounds for commands that take about a second (a loaded machine)
BUDGET = {
    "publish": 150.0,
    "run": 150.0,
    "repartition": 120.0,
    "group-reset": 90.0,
    "group-rebalance": 120.0,
    "dead-letters-replay": 90.0,
    "dead-letters-purge": 90.0,
    "drain": 150.0,
    "global-drain": 150.0,
    "final-global-drain": 300.0,
    "status": 60.0,
    "leave": 90.0,  # a SIGTERM'd worker or pool: commit, release, exit
    "final-drain": 300.0,
}
SERVICES = ("worker-join", "pool-join")
READERS = ("global-read-join",)

_T = TypeVar("_T")


@dataclass
class Options:
    seed: int
    seconds: float
    workdir: Path
    cluster: bool = False
    skip_known: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset(OPERATIONS)
    faults: frozenset[str] = frozenset(FAULTS)
    fault_rate: float = 0.12  # faults per second
    tick: tuple[float, float] = (0.2, 1.2)
    partitions: int = 4
    #: accounts and one user per role: every process connects with its role's set only
    least_privilege: bool = False
    #: every publish stamps a global sequence; global-order readers join and leave
    global_order: bool = False


@dataclass
class Result:
    seed: int
    violations: list[Violation]
    history: History
    workdir: Path
    elapsed: float
    counts: dict[str, int] = field(default_factory=dict)


class Explorer:
    def __init__(self, opts: Options) -> None:
        self.o = opts
        self.rng = random.Random(opts.seed)
        self.history = History(opts.seed)
        opts.workdir.mkdir(parents=True, exist_ok=True)
        self.sink = opts.workdir / "sink.db"
        self.global_sink = opts.workdir / "global.db"
        self.world = World(opts.workdir, opts.partitions)
        ops = opts.ops - NOT_GLOBAL if opts.global_order else opts.ops - GLOBAL_OPS
        self.gen = Generator(
            random.Random(self.rng.random()),
            self.world,
            enabled=ops,
            skip_known=opts.skip_known,
            poison="dead-letters-replay" in ops or "dead-letters-purge" in ops,
            global_order=opts.global_order,
        )
        self.nemesis = Nemesis(
            random.Random(self.rng.random()),
            rate=opts.fault_rate,
            cluster=opts.cluster,
            enabled=opts.faults,
            skip_known=opts.skip_known,
        )
        self.server: NatsServer | None = None
        self.cluster: NatsCluster | None = None
        self.servers = ""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env["CHAOS_SINK"] = str(self.sink)
        env["GLOBAL_SINK"] = str(self.global_sink)
        env["CHAOS_DELAY"] = "0.002"
        env.pop("NATS_URL", None)
        for name in ("NATS_USER", "NATS_PASSWORD", "NATS_TOKEN", "NATS_CREDS", "NATS_NKEY"):
            env.pop(name, None)
        self.procs = Processes(self.history, opts.workdir, env)
        self.accounts = (
            Accounts(STREAM, GROUP, GLOBAL_GROUP if opts.global_order else None)
            if opts.least_privilege
            else None
        )
        self._server_env: list[str] = []  # the password variables set for the server
        self._conn_sampled = 0.0  # when the server's connections were last listed
        self.users_seen: Counter[str] = Counter()  # connections seen per user
        self.wrong_users: list[str] = []  # processes not connected as their role's user
        self.liveness: list[str] = []
        self.drains: list[DrainClaim] = []
        self.global_drains: list[DrainClaim] = []
        self.lags: list[LagClaim] = []
        self.resumes: list[tuple[float, Running]] = []
        self.down: list[tuple[float, int]] = []  # cluster nodes to start again (when, index)
        self.busy: dict[int, str] = {}  # command id -> producer id it publishes
        self.aimed_hits: list[Running] = []  # aimed-at publishes a timer killed (to note)
        self.aimed: list[tuple[float, Running]] = []  # repartitions, global publishes to SIGKILL
        self.final = False

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        t0 = time.monotonic()
        violations: list[Violation] = []
        try:
            self._setup()
            self._chaos()
            self._final()
            if self.o.global_order:
                self._final_global()
            facts = self._facts()
            skip = frozenset(
                SKIPPED_INVARIANTS[n] for n in self.o.skip_known if n in SKIPPED_INVARIANTS
            )
            violations = check(facts, skip=skip)
        except Exception as exc:  # the explorer itself failed: say so with the history
            import traceback

            violations = [
                Violation("explorer", f"the explorer stopped: {exc!r}\n{traceback.format_exc()}")
            ]
        finally:
            self._teardown()
            self.history.save(self.o.workdir / "history.json")
        counts = Counter(c.op for c in self.history.commands.values())
        counts.update(
            f"fault:{e.text.split()[0]}" for e in self.history.events if e.kind == "fault"
        )
        return Result(
            self.o.seed,
            violations,
            self.history,
            self.o.workdir,
            time.monotonic() - t0,
            dict(counts),
        )

    def _setup(self) -> None:
        self.history.note(
            f"seed {self.o.seed}, {self.o.seconds:.0f}s, "
            f"{'3-node cluster' if self.o.cluster else 'single server'}, "
            f"skip-known {','.join(sorted(self.o.skip_known)) or 'none'}"
            + (", least privilege" if self.accounts is not None else "")
            + (", global order" if self.o.global_order else ""),
            "phase",
        )
        extra = ""
        if self.accounts is not None:
            # the server (and every restart of it) reads the users' passwords from its
            # environment, which it inherits from this process; the commands' environment
            # was copied before, so each gets only its own user's password
            for name, value in self.accounts.server_env().items():
                os.environ[name] = value
                self._server_env.append(name)
            extra = self.accounts.config()
        if self.o.cluster:
            self.cluster = NatsCluster(self.o.workdir / "cluster", n=3, extra_config=extra).start()
            self.servers = ",".join(self.cluster.urls)
        else:
            self.server = NatsServer(
                self.o.workdir / "nats", name="explore", extra_config=extra
            ).start()
            self.servers = self.server.url
        with sqlite3.connect(self.sink) as db:
            db.execute(EVENTS_DDL)
        with sqlite3.connect(self.global_sink) as db:
            db.execute(HANDOVERS_DDL)
        argv = [
            *CLI,
            "provision",
            "--stream",
            STREAM,
            "--partitions",
            str(self.o.partitions),
            "--duplicate-window",
            "1h",
            "--replicas",
            "3" if self.o.cluster else "1",
            "--server",
            self.servers,
        ]
        run = self._sync("provision", argv, 120.0)
        if run.cmd.exit_code != 0:
            raise RuntimeError(f"provision failed: {self.procs.log_tail(run)}")

    def _chaos(self) -> None:
        self.history.note("chaos", "phase")
        end = time.monotonic() + self.o.seconds
        last = time.monotonic()
        while time.monotonic() < end:
            time.sleep(self.rng.uniform(*self.o.tick))
            self._tick()
            now = time.monotonic()
            fault = self.nemesis.next(now - last, self._targets())
            last = now
            if fault is not None:
                self._inject(fault)
            if self.rng.random() < 0.7:
                action = self.gen.next(self._running_ops(), set(self.busy.values()))
                if action is not None:
                    self._start(action)

    # ------------------------------------------------------------------ bookkeeping
    def _running_ops(self) -> dict[str, int]:
        return dict(
            Counter(r.cmd.op for r in self.procs.running.values() if not r.cmd.info.get("leaving"))
        )

    def _targets(self) -> list[tuple[int, str]]:
        return [(c, r.cmd.op) for c, r in self.procs.running.items() if not r.stopped]

    def _tick(self) -> None:
        """Resume what is due, note ended commands and liveness problems."""
        now = time.monotonic()
        for due, run in list(self.resumes):
            if due <= now:
                self.resumes.remove((due, run))
                self.procs.signal_group(run, signal.SIGCONT)
                run.stopped = False
                self.history.fault(f"SIGCONT {run.cmd.op} #{run.cmd.id}", run.cmd)
        while self.aimed_hits:
            shot = self.aimed_hits.pop(0)
            self.history.fault(f"SIGKILL {shot.cmd.op} #{shot.cmd.id} (aimed)", shot.cmd)
        for due, run in list(self.aimed):
            if due <= now:
                self.aimed.remove((due, run))
                if run.cmd.id in self.procs.running and not self.final:
                    run.cmd.info["killed"] = True
                    self.procs.signal_group(run, signal.SIGKILL)
                    self.history.fault(f"SIGKILL {run.cmd.op} #{run.cmd.id} (aimed)", run.cmd)
        for due, i in list(self.down):
            if due <= now and self.cluster is not None:
                self.down.remove((due, i))
                try:
                    self.cluster.servers[i].start()
                    self.history.fault(f"node-start n{i}")
                except Exception as exc:  # noqa: BLE001 - a node that cannot start is a finding
                    self.liveness.append(f"cluster node n{i} did not start again: {exc}")
        if self.accounts is not None and now - self._conn_sampled >= 1.0:
            self._conn_sampled = now
            self._sample_connections()
        ended, problems = self.procs.poll()
        for run in ended:
            self._ended(run)
        for p in problems:
            cid = int(p.split()[0][1:])
            hit = self.procs.running.get(cid)
            tail = self.procs.log_tail(hit, 1500) if hit else ""
            self.liveness.append(f"{p}\n    log tail: {tail!r}")
            self.history.note(f"LIVENESS {p}")
            if hit is not None and hit.flagged_hung:
                self.history.finish(hit.cmd, "hung: killed by the explorer")
                self.procs.signal_group(hit, signal.SIGCONT)
                self.procs.signal_group(hit, signal.SIGKILL)

    def _sample_connections(self) -> None:
        """List the server's connections: every process of the explorer must be connected
        as its role's user (the mode would prove nothing if one fell back to the admin)."""
        servers = [self.server, *(self.cluster.servers if self.cluster else [])]
        for srv in servers:
            if srv is None or not srv.running or srv._paused:
                continue
            conns = connections(srv.monitor_url)
            self.users_seen.update(u for n, u in conns if n != CHECKER_NAME)
            for bad in wrong_users(conns):
                if bad not in self.wrong_users:
                    self.wrong_users.append(bad)
                    self.history.note(f"LEAST-PRIVILEGE {bad}")

    def _ended(self, run: Running) -> None:
        cmd = run.cmd
        self.busy.pop(cmd.id, None)
        if cmd.op == "repartition" and cmd.exit_code == 0:
            # a run that completed an interrupted one reports that one's count
            res = cmd.result if isinstance(cmd.result, dict) else {}
            self.world.partitions = int(res.get("partitions", cmd.info["partitions"]))
        if cmd.op in ("publish", "publish-again", "run", "run-again") and cmd.exit_code == 0:
            prod = self.world.producers[cmd.info["producer"]]
            if cmd.op.startswith("publish") or (
                isinstance(cmd.result, dict) and cmd.result.get("status") == "complete"
            ):
                prod.complete = True
        if cmd.op in ("global-drain", "final-global-drain") and cmd.exit_code == 0:
            self.global_drains.append(
                DrainClaim(
                    cmd.id,
                    int(cmd.info["high_water"]),
                    self._last_row(self.global_sink, "handovers"),
                )
            )
        if cmd.op in ("drain", "final-drain") and cmd.exit_code == 0:
            self.drains.append(
                DrainClaim(cmd.id, int(cmd.info["high_water"]), self._last_row(self.sink, "events"))
            )

    # ------------------------------------------------------------------ operations
    def _launch(
        self,
        op: str,
        argv: list[str],
        *,
        budget: float | None,
        env: dict[str, str] | None = None,
        as_op: str | None = None,
        **info: object,
    ) -> Running:
        """Start a command; with least privilege, connected as the user of its role
        (``explore.privilege.OP_USERS``; ``as_op`` names the role's row when the
        operation's command varies, e.g. ``group list`` for a ``status``)."""
        if self.accounts is not None:
            user = OP_USERS[as_op or op]
            env = {**(env or {}), **self.accounts.client_env(user)}
            info["user"] = user
        return self.procs.start(op, argv, budget=budget, env=env, **info)

    def _cli(self, *args: str) -> list[str]:
        return [*CLI, *args, "--server", self.servers]

    def _member_flags(self) -> list[str]:
        return [
            "--stream",
            STREAM,
            "--group",
            GROUP,
            "--handler",
            HANDLER,
            "--lease-ttl",
            "2",
            "--max-retries",
            "1",
            "--retry-backoff",
            "0.05",
            "--commit-every",
            "20",
        ]

    def _publish_argv(self, prod: Producer) -> list[str]:
        if prod.kind == "run":
            return [
                sys.executable,
                "-m",
                "explore.publish_run_child",
                self.servers,
                STREAM,
                prod.id,
                str(prod.path),
                *(["--global-order"] if self.o.global_order else []),
            ]
        return self._cli(
            "publish",
            "--stream",
            STREAM,
            str(prod.path),
            "--key-field",
            "k",
            "--producer-id",
            prod.id,
            "--json",
            "--ack-timeout",
            "2",
            "--delivery-timeout",
            "30",
            *(["--global-order"] if self.o.global_order else []),
        )

    def _start(self, action: Action) -> Running | None:
        op, p = action.op, action.params
        if op in ("publish", "publish-again", "run", "run-again"):
            prod = self.world.producers[p["producer"]]
            run = self._launch(
                op,
                self._publish_argv(prod),
                budget=BUDGET["publish"],
                producer=prod.id,
                records=len(prod.records),
            )
            prod.publishes.append(run.cmd.id)
            self.busy[run.cmd.id] = prod.id
            aim = None
            if self.o.global_order and not self.final:
                aim = self.nemesis.aim_at_global_publish()
            if aim is not None:
                # a publish lasts about a second: a timer, not the tick, kills it in time
                timer = threading.Timer(aim, self._kill_aimed, (run,))
                timer.daemon = True
                timer.start()
                self.history.note(f"nemesis aims at {op} #{run.cmd.id}: +{aim:.1f}s")
            if any(r.cmd.op == "repartition" for r in self.procs.running.values()):
                prod.repartitioned = True
            return run
        if op == "worker-join":
            argv = self._cli("worker", *self._member_flags(), "--member-id", p["member"])
            return self._launch(
                op, argv, budget=None, env={"CHAOS_MEMBER": p["member"]}, members=p["member"]
            )
        if op == "pool-join":
            argv = self._cli(
                "pool",
                *self._member_flags(),
                "--size",
                str(p["size"]),
                "--member-prefix",
                p["prefix"],
                "--restart-backoff",
                "0.5",
                "--stop-timeout",
                "30",
            )
            return self._launch(op, argv, budget=None, members=p["prefix"])
        if op == "global-read-join":
            argv = self._cli(
                "global-read",
                "--stream",
                STREAM,
                "--group",
                GLOBAL_GROUP,
                "--handler",
                GLOBAL_HANDLER,
                "--member-id",
                p["reader"],
                "--commit-every",
                "20",
                "--commit-interval",
                "0.5",
                "--fetch-batch",
                "100",
            )
            return self._launch(
                op, argv, budget=None, env={"GLOBAL_READER": p["reader"]}, reader=p["reader"]
            )
        if op in ("worker-leave", "pool-leave", "global-read-leave"):
            kind = {"worker-leave": "worker-join", "pool-leave": "pool-join"}.get(
                op, "global-read-join"
            )
            live = [
                r
                for r in self.procs.running.values()
                if r.cmd.op == kind and not r.cmd.info.get("leaving")
            ]
            if not live:
                return None
            run = self.rng.choice(sorted(live, key=lambda r: r.cmd.id))
            self._leave(run)
            return run
        if op == "repartition":
            self.world.repartitions_started += 1
            for pid in self.busy.values():
                self.world.producers[pid].repartitioned = True
            argv = self._cli(
                "repartition", "--stream", STREAM, "--partitions", str(p["partitions"]), "--json"
            )
            crash = None if self.final else self.nemesis.crash_repartition_at(CRASH_POINTS)
            run = self._launch(
                op,
                argv,
                budget=BUDGET[op],
                env={CRASH_ENV: crash} if crash else None,
                # every other one as the group's operator: docs/security.md says that
                # set repartitions too (the explorer's stream has one group)
                as_op="repartition-g" if self.world.repartitions_started % 2 else "repartition",
                partitions=p["partitions"],
            )
            if crash:
                self.history.note(f"nemesis: repartition #{run.cmd.id} crashes at {crash}")
            delay = self.nemesis.aim_at_repartition() if not self.final and not crash else None
            if delay is not None:
                self.aimed.append((time.monotonic() + delay, run))
                self.history.note(f"nemesis aims at repartition #{run.cmd.id}: +{delay:.1f}s")
            return run
        if op == "group-reset":
            extra = ["--partitions", p["partitions"]] if p.get("partitions") else []
            argv = self._cli(
                "group",
                "reset",
                "--stream",
                STREAM,
                "--group",
                GROUP,
                "--to",
                "earliest",
                "--execute",
                "--json",
                *extra,
            )
            return self._launch(op, argv, budget=BUDGET[op], to="earliest")
        if op == "group-rebalance":
            argv = self._cli(
                "group",
                "rebalance",
                "--stream",
                STREAM,
                "--group",
                GROUP,
                "--timeout",
                "30s",
                "--json",
            )
            return self._launch(op, argv, budget=BUDGET[op])
        if op == "dead-letters-replay":
            argv = self._cli(
                "dead-letters",
                "replay",
                "--stream",
                STREAM,
                "--group",
                GROUP,
                "--json",
                *(["--purge"] if p.get("purge") else []),
            )
            return self._launch(op, argv, budget=BUDGET[op], purge=bool(p.get("purge")))
        if op == "dead-letters-purge":
            letters = self._nats(lambda nc: read_stream(nc, f"{STREAM}_DLQ", patience=5.0), 20.0)
            if not letters:
                return None
            chosen = [s for s in letters if self.rng.random() < 0.5] or letters[:1]
            gids = {json.loads(s.data)["i"] for s in chosen}
            self.world.purged |= gids
            argv = self._cli(
                "dead-letters",
                "purge",
                "--stream",
                STREAM,
                "--group",
                GROUP,
                "--seq",
                ",".join(str(s.seq) for s in chosen),
                "--json",
            )
            return self._launch(op, argv, budget=BUDGET[op], purge=sorted(gids))
        if op == "drain":
            return self._drain("drain", "90s")
        if op == "global-drain":
            return self._drain("global-drain", "90s", GLOBAL_GROUP)
        if op == "status":
            if self.rng.random() < 0.5:
                argv = self._cli("status", "--stream", STREAM, "--group", GROUP, "--json")
                return self._launch(op, argv, budget=BUDGET[op])
            argv = self._cli("group", "list", "--stream", STREAM, "--json")
            return self._launch(op, argv, budget=BUDGET[op], as_op="group-list")
        raise ValueError(f"unknown operation {op}")

    def _drain(self, op: str, timeout: str, group: str = GROUP) -> Running | None:
        high = self._nats(self._last_seq, 20.0)
        if high is None:
            return None
        argv = self._cli(
            "status",
            "--stream",
            STREAM,
            "--group",
            group,
            "--wait-drained",
            "--timeout",
            timeout,
            "--no-members-timeout",
            "60s",
            "--json",
        )
        return self._launch(op, argv, budget=BUDGET[op], high_water=high)

    def _kill_aimed(self, run: Running) -> None:
        """(A timer's thread) SIGKILL an aimed-at publish still running; the history notes
        it at the next tick (the history is the main thread's)."""
        if self.final or run.proc.returncode is not None or run.proc.poll() is not None:
            return
        run.cmd.info["killed"] = True
        self.procs.signal_group(run, signal.SIGKILL)
        self.aimed_hits.append(run)

    def _leave(self, run: Running) -> None:
        """SIGTERM a worker or pool: it must leave (exit) within BUDGET['leave']."""
        run.cmd.info["leaving"] = True
        run.cmd.deadline = self.history.now() + BUDGET["leave"]
        if run.stopped:
            self.procs.signal_group(run, signal.SIGCONT)
            run.stopped = False
        self.history.note(f"SIGTERM {run.cmd.op} #{run.cmd.id} (leave)")
        self.procs.signal(run, signal.SIGTERM)

    # ------------------------------------------------------------------ faults
    def _inject(self, fault: Fault) -> None:
        if fault.kind in ("kill", "pause"):
            assert fault.command is not None
            run = self.procs.running.get(fault.command)
            if run is None:
                return
            if fault.kind == "kill" and fault.member:
                kids = [p for p in _descendants(run.proc.pid) if _is_python(p)]
                if kids:
                    victim = self.rng.choice(sorted(kids))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                    self.history.fault(
                        f"SIGKILL member pid {victim} of pool #{run.cmd.id}", run.cmd
                    )
                    return
            if fault.kind == "kill":
                run.cmd.info["killed"] = True
                self.procs.signal_group(run, signal.SIGKILL)
                self.history.fault(f"SIGKILL {run.cmd.op} #{run.cmd.id}", run.cmd)
                return
            self.procs.signal_group(run, signal.SIGSTOP)
            run.stopped = True
            self.resumes.append((time.monotonic() + fault.duration, run))
            self.history.fault(f"SIGSTOP {run.cmd.op} #{run.cmd.id} for {fault.duration}s", run.cmd)
            return
        if fault.kind == "server-restart" and self.server is not None:
            self.history.fault(f"server-restart ({'SIGKILL' if fault.hard else 'SIGTERM'})")
            try:
                self.server.restart(hard=fault.hard)
            except Exception as exc:  # noqa: BLE001
                self.liveness.append(f"nats-server did not start again: {exc}")
                raise
            self.history.note("server up")
            return
        if fault.kind == "leader-kill" and self.cluster is not None:
            up = [i for i, s in enumerate(self.cluster.servers) if s.running]
            if len(up) < 3:
                return  # one node down at a time: the cluster keeps its quorum
            try:
                i = self.cluster.stream_leader(STREAM, timeout=3.0)
                what = "stream leader"
            except Exception:  # noqa: BLE001 - no leader known: any node
                i, what = self.rng.choice(up), "node"
            self.cluster.kill(i)
            self.down.append((time.monotonic() + fault.duration, i))
            self.history.fault(f"leader-kill {what} n{i} for {fault.duration}s")

    # ------------------------------------------------------------------ final phase
    def _final(self) -> None:
        self.history.note("final: no more faults; let commands end", "phase")
        self.final = True
        self.aimed.clear()
        for _, run in list(self.resumes):
            self.procs.signal_group(run, signal.SIGCONT)
            run.stopped = False
        self.resumes.clear()
        if self.cluster is not None:
            for _, i in list(self.down):
                self.cluster.servers[i].start()
            self.down.clear()
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and any(
            r.cmd.op not in SERVICES + READERS for r in self.procs.running.values()
        ):
            time.sleep(0.3)
            self._tick()
        # a repartition left interrupted is completed, as an operator would: run it again
        pending = self._layout_pending()
        if pending is not None:
            self.history.note(f"final: {pending}; repartition again", "phase")
            target = self._last_repartition_target()
            self._start_sync(Action("repartition", {"partitions": target}))
        # inputs left partial are published again (same producer id)
        for prod in list(self.world.producers.values()):
            if prod.complete:
                continue
            op = "publish-again" if prod.kind == "cli" else "run-again"
            self._publish_sync(Action(op, {"producer": prod.id}))
        if self.world.partitions == 1 and "repartition" in self.o.ops:
            # one partition's lag is exact even when computed from stream sequences: give
            # the lag check partitions whose sequences interleave
            self._start_sync(Action("repartition", {"partitions": 3}))
        if not any(r.cmd.op in SERVICES for r in self.procs.running.values()):
            self._start(Action("worker-join", {"member": self.gen.name("w")}))
        drained = self._final_drain()
        if drained and self.gen.poison:
            self._sync(
                "dead-letters-replay",
                self._cli("dead-letters", "replay", "--stream", STREAM, "--group", GROUP, "--json"),
                BUDGET["dead-letters-replay"],
            )
            drained = self._final_drain()
        if not drained:
            return
        high = self.drains[-1].high_water
        self.history.note("final: every member leaves; one more input; lag", "phase")
        for run in [r for r in self.procs.running.values() if r.cmd.op in SERVICES]:
            self._leave(run)
        end = time.monotonic() + BUDGET["leave"] + 10
        while time.monotonic() < end and any(
            r.cmd.op in SERVICES for r in self.procs.running.values()
        ):
            time.sleep(0.3)
            self._tick()
        if any(r.cmd.op in SERVICES for r in self.procs.running.values()):
            return  # the leave deadline was reported as a liveness problem
        prod = self.world.new_input("cli", 60, 0.0, [self.rng.random() for _ in range(60)], "last")
        last = self._publish_sync(Action("publish", {"producer": prod.id}))
        if last is None or last.cmd.exit_code != 0:
            self.liveness.append("the last publish (no worker running) did not succeed")
            return
        status = self._sync(
            "status", self._cli("status", "--stream", STREAM, "--group", GROUP, "--json"), 60.0
        )
        if isinstance(status.cmd.result, dict):
            self.lags.append(LagClaim("status", int(status.cmd.result["total_lag"]), high))
        listing = self._sync(
            "status",
            self._cli("group", "list", "--stream", STREAM, "--json"),
            60.0,
            as_op="group-list",
        )
        if isinstance(listing.cmd.result, dict):
            for g in listing.cmd.result.get("groups", []):
                if g.get("group") == GROUP:
                    self.lags.append(LagClaim("group list", int(g["total_lag"]), high))

    def _publish_sync(self, action: Action) -> Running | None:
        """A publish of the final phase; with --global-order tried again while it fails
        (a SIGKILLed global-order publisher's sequencer claim lapses after 10 s only)."""
        run = self._start_sync(action)
        prod = self.world.producers[action.params["producer"]]
        for _ in range(6 if self.o.global_order else 0):
            if prod.complete or run is None:
                break
            self.history.note(f"final: {prod.id} not complete; again in 4 s")
            end = time.monotonic() + 4
            while time.monotonic() < end:
                time.sleep(0.3)
                self._tick()
            again = "publish-again" if prod.kind == "cli" else "run-again"
            run = self._start_sync(Action(again, action.params))
        return run

    def _final_global(self) -> None:
        """A global-order reader runs until group gg's position is at every partition's
        end (``status --wait-drained --group gg``); then every reader leaves (SIGTERM)."""
        self.history.note("final: a global-order reader hands everything over", "phase")
        if not any(
            r.cmd.op in READERS and not r.cmd.info.get("leaving")
            for r in self.procs.running.values()
        ):
            self._start(Action("global-read-join", {"reader": self.gen.name("gr")}))
        run = self._drain("final-global-drain", "240s", GLOBAL_GROUP)
        if run is None:
            self.liveness.append("final global drain: the stream's last sequence was unreadable")
        else:
            self._wait(run)
            if run.cmd.exit_code != 0:
                self.liveness.append(
                    f"final global drain #{run.cmd.id} did not end drained ({run.cmd.outcome}): "
                    f"{self.procs.log_tail(run, 1500)!r}"
                )
        for r in [r for r in self.procs.running.values() if r.cmd.op in READERS]:
            if not r.cmd.info.get("leaving"):
                self._leave(r)
        end = time.monotonic() + BUDGET["leave"] + 10
        while time.monotonic() < end and any(
            r.cmd.op in READERS for r in self.procs.running.values()
        ):
            time.sleep(0.3)
            self._tick()

    def _layout_pending(self) -> str | None:
        """What is left of an interrupted repartition (None: nothing, or unreadable)."""

        async def read(nc: Any) -> str | None:
            s = await describe(nc, STREAM, check_layout=False)
            if not interrupted(s):
                return None
            return (
                f"the repartition to epoch {s.layout.epoch} is interrupted (subjects "
                f"{s.config.subjects}, pending switch {s.pending_switch})"
            )

        return self._nats(read, 60.0)

    def _last_repartition_target(self) -> int:
        reps = [c for c in self.history.commands.values() if c.op == "repartition"]
        return int(reps[-1].info["partitions"]) if reps else self.world.partitions

    def _final_drain(self) -> bool:
        run = self._drain("final-drain", "240s")
        if run is None:
            self.liveness.append("final drain: the stream's last sequence could not be read")
            return False
        self._wait(run)
        if run.cmd.exit_code != 0:
            self.liveness.append(
                f"final drain #{run.cmd.id} did not end drained ({run.cmd.outcome}): "
                f"{self.procs.log_tail(run, 1500)!r}"
            )
            return False
        return True

    def _start_sync(self, action: Action) -> Running | None:
        run = self._start(action)
        if run is not None:
            self._wait(run)
        return run

    def _sync(self, op: str, argv: list[str], budget: float, as_op: str | None = None) -> Running:
        run = self._launch(op, argv, budget=budget, as_op=as_op)
        self._wait(run)
        return run

    def _wait(self, run: Running) -> None:
        while run.cmd.id in self.procs.running:
            time.sleep(0.2)
            self._tick()

    # ------------------------------------------------------------------ reading back
    def _nats(self, fn: Callable[[Any], Awaitable[_T]], timeout: float) -> _T | None:
        import nats

        async def quiet(exc: Exception) -> None:
            # a node the nemesis killed refuses the connection: the client tries the next;
            # nats-py's default callback would print each attempt's traceback
            self.history.note(f"explorer read: {exc!r}")

        async def go() -> _T:
            nc = await nats.connect(
                servers=self.servers.split(","),
                connect_timeout=3,
                max_reconnect_attempts=3,
                name=CHECKER_NAME,
                error_cb=quiet,
            )
            try:
                return await asyncio.wait_for(fn(nc), timeout)
            finally:
                await nc.close()

        try:
            return asyncio.run(go())
        except Exception as exc:  # noqa: BLE001 - the caller treats None as "unknown now"
            self.history.note(f"explorer read failed: {exc!r}")
            return None

    @staticmethod
    async def _last_seq(nc: Any) -> int:
        info = await nc.jetstream().stream_info(STREAM)
        return int(info.state.last_seq)

    @staticmethod
    def _last_row(path: Path, table: str) -> int:
        """The id of the last row of ``table`` (the sink's ``events``, the global readers'
        ``handovers``); 0 when empty."""
        with sqlite3.connect(path, timeout=60) as db:
            return int(db.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()[0])

    def _facts(self) -> Facts:
        stored_raw = self._nats(lambda nc: read_stream(nc, STREAM, patience=60.0), 300.0)
        if stored_raw is None:
            raise RuntimeError("could not read the stream back")
        stored: list[StoredRecord] = []
        global_stored: list[GlobalStored] = []  # with --global-order only
        for s in stored_raw:
            i = int(json.loads(s.data)["i"])
            stored.append(StoredRecord(s.seq, s.subject, i, s.msg_id.startswith("replay-")))
            if self.o.global_order:
                global_stored.append(GlobalStored(s.seq, i, s.global_seq))
        with sqlite3.connect(self.global_sink, timeout=60) as db:
            handed = [
                Handover(int(row), str(reader), int(g), int(seq), int(i))
                for row, reader, g, seq, i in db.execute(
                    "SELECT id, reader, g, seq, i FROM handovers ORDER BY id"
                )
            ]
        letters = self._nats(lambda nc: _read_or_empty(nc, f"{STREAM}_DLQ"), 120.0) or []
        with sqlite3.connect(self.sink, timeout=60) as db:
            applied = [
                AppliedRecord(int(i), int(g), int(s))
                for i, g, s in db.execute("SELECT id, i, seq FROM events ORDER BY id")
            ]
        writers = [
            c
            for c in self.history.commands.values()
            if c.op in ("publish", "publish-again", "run", "run-again", "dead-letters-replay")
        ]

        def alone(cmd: Command) -> bool:
            end = cmd.end if cmd.end is not None else float("inf")
            return not any(
                w.id != cmd.id
                and w.start < end
                and (w.end if w.end is not None else float("inf")) > cmd.start
                for w in writers
            )

        publishes = []
        for prod in self.world.producers.values():
            for cid in prod.publishes:
                cmd = self.history.commands[cid]
                res = cmd.result if isinstance(cmd.result, dict) else None
                ok = cmd.exit_code == 0
                if prod.kind == "run":
                    ok = ok and res is not None and res.get("status") == "complete"
                publishes.append(
                    PublishReport(
                        cid,
                        prod.kind,
                        prod.id,
                        len(prod.records),
                        complete=ok,
                        summary=res is not None and "acked" in res,
                        acked=int(res.get("acked", 0)) if res else 0,
                        duplicates=int(res.get("duplicates", 0)) if res else 0,
                        unexpected_duplicates=int(res.get("unexpected_duplicates", 0))
                        if res
                        else 0,
                        repartitioned=prod.repartitioned,
                        alone=alone(cmd),
                    )
                )
        return Facts(
            inputs=self.world.inputs(),
            stored=stored,
            applied=applied,
            publishes=publishes,
            drains=self.drains,
            lags=self.lags,
            purged=set(self.world.purged),
            dead_letters={int(json.loads(s.data)["i"]) for s in letters},
            liveness=self.liveness,
            layout_pending=self._layout_pending(),
            denials=self._denials(),
            global_stored=global_stored,
            handed=handed,
            readers=self._readers(),
            global_drains=self.global_drains,
            members=[
                MemberExit(
                    run.cmd.id,
                    run.cmd.op,
                    run.cmd.exit_code,
                    leaving=bool(run.cmd.info.get("leaving")),
                    killed=bool(run.cmd.info.get("killed")),
                    tail=self.procs.log_tail(run, 800),
                    starting=_sigterm_while_starting(run.cmd.exit_code, self.procs.log_tail(run)),
                    joined="joined group" in self.procs.log_tail(run, 10**7),
                )
                for run in self.procs.done.values()
                if run.cmd.op in SERVICES and run.cmd.outcome != "killed at the end"
            ],
        )

    def _readers(self) -> list[ReaderRun]:
        runs = sorted(
            [
                *[r for r in self.procs.done.values() if r.cmd.op in READERS],
                *[r for r in self.procs.running.values() if r.cmd.op in READERS],
            ],
            key=lambda r: r.cmd.start,
        )
        out = []
        for run in runs:
            log = self.procs.log_tail(run, 10**7)
            at = log.find(RESUMING)
            resumed = None
            if at >= 0:
                resumed = int(log[at + len(RESUMING) :].split()[0].rstrip(",.;:"))
            out.append(
                ReaderRun(
                    run.cmd.id,
                    str(run.cmd.info["reader"]),
                    resumed,
                    run.cmd.exit_code,
                    leaving=bool(run.cmd.info.get("leaving")),
                    # still running (its leave deadline was reported) or killed by the
                    # explorer (hung: liveness says so): no exit to judge
                    killed=bool(run.cmd.info.get("killed"))
                    or run.cmd.id in self.procs.running
                    or (run.cmd.outcome or "").startswith(("hung", "killed at the end")),
                    superseded=any(o.cmd.start > run.cmd.start for o in runs),
                    tail=self.procs.log_tail(run, 800),
                )
            )
        return out

    def _teardown(self) -> None:
        self.procs.kill_all()
        for srv in [self.server, *(self.cluster.servers if self.cluster else [])]:
            if srv is not None:
                with contextlib.suppress(Exception):
                    srv.resume()
                    srv.stop()
        for name in self._server_env:
            os.environ.pop(name, None)

    def _denials(self) -> list[str]:
        """Every refusal the history shows: a command's log reporting a denied permission
        (with the user it ran as) and each server's ``Permissions Violation`` lines."""
        out = []
        for run in sorted(self.procs.done.values(), key=lambda r: r.cmd.id):
            user = run.cmd.info.get("user", "default")
            out += [
                f"#{run.cmd.id} {run.cmd.op} (user {user}): {line}"
                for line in client_denials(self.procs.log_tail(run, 10**7))
            ]
        servers = [self.server, *(self.cluster.servers if self.cluster else [])]
        if self.accounts is not None:
            seen = ", ".join(f"{u or 'none'} {n}" for u, n in sorted(self.users_seen.items()))
            self.history.note(f"least privilege: connections per user, over the samples: {seen}")
        out += self.wrong_users
        return out + server_violations(s.log_path for s in servers if s is not None)


async def _read_or_empty(nc: Any, stream: str) -> list[Any]:
    from nats.js.errors import NotFoundError

    try:
        return await read_stream(nc, stream, patience=30.0)
    except NotFoundError:
        return []


def _sigterm_while_starting(code: int | None, log: str) -> bool:
    """A worker dead by SIGTERM before it logged anything, or a pool whose members that did
    not leave gracefully were all killed by SIGTERM (see MemberExit.starting)."""
    if code == -signal.SIGTERM:
        return not log.strip()
    marker = "not every member left gracefully: "
    if code != 1 or marker not in log:
        return False
    failed = log.rsplit(marker, 1)[1].splitlines()[0].split(", ")
    return all(f.endswith("(killed by SIGTERM)") for f in failed)


def _is_python(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"python" in f.read().split(b"\0")[0]
    except OSError:
        return False
