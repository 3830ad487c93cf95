"""The processes the explorer starts: each in its own process group, watched and reaped.

Every command runs in a new session (its own process group), so a fault or the final
clean-up reaches its children too (a pool's members). :meth:`Processes.poll` notes exits,
samples CPU use (a process that should wait but burns a core is flagged) and reports
commands past their deadline; :meth:`Processes.kill_all` leaves nothing running, also when
the run fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .history import Command, History

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of ``pid`` and all its descendants (0 if gone)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, IndexError, ValueError):
            continue
    return total


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


@dataclass
class Running:
    cmd: Command
    proc: subprocess.Popen[bytes]
    log_path: Path
    stopped: bool = False  # SIGSTOPped by the nemesis, not yet resumed
    samples: list[tuple[float, float]] = field(default_factory=list)  # (wall, cpu)
    flagged_spin: bool = False
    flagged_hung: bool = False


class Processes:
    """Start, watch, signal and reap the explorer's commands (see the module)."""

    #: a process using at least this share of one CPU over SPIN_WINDOW seconds spins
    SPIN_SHARE = 0.9
    SPIN_WINDOW = 20.0

    def __init__(self, history: History, workdir: Path, env: dict[str, str]) -> None:
        self.history = history
        self.workdir = workdir
        self.env = env
        self.running: dict[int, Running] = {}
        self.done: dict[int, Running] = {}

    def start(
        self,
        op: str,
        argv: list[str],
        *,
        budget: float | None,
        env: dict[str, str] | None = None,
        **info: object,
    ) -> Running:
        cmd = self.history.begin(op, argv, budget=budget, **info)
        log_path = self.workdir / "logs" / f"{cmd.id:04d}-{op}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out_path = log_path.with_suffix(".out")
        with open(log_path, "wb") as err, open(out_path, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        cmd.info["pid"] = proc.pid
        run = Running(cmd, proc, log_path)
        self.running[cmd.id] = run
        return run

    def poll(self) -> tuple[list[Running], list[str]]:
        """Reap ended commands (returned) and report liveness problems (hung past the
        deadline, spinning): each as a line, once per command."""
        ended: list[Running] = []
        problems: list[str] = []
        now = self.history.now()
        for cid, run in list(self.running.items()):
            code = run.proc.poll()
            if code is not None:
                self._reap(run, code)
                ended.append(run)
                del self.running[cid]
                continue
            wall = time.monotonic()
            run.samples.append((wall, _cpu_seconds(run.proc.pid)))
            while len(run.samples) > 2 and wall - run.samples[1][0] >= self.SPIN_WINDOW:
                run.samples.pop(0)
            (w0, c0), (w1, c1) = run.samples[0], run.samples[-1]
            if w1 - w0 >= self.SPIN_WINDOW and not run.stopped:
                share = (c1 - c0) / (w1 - w0)
                run.cmd.max_cpu = max(run.cmd.max_cpu, round(share, 2))
                if share >= self.SPIN_SHARE and not run.flagged_spin:
                    run.flagged_spin = True
                    run.cmd.info["spin"] = round(share, 2)
                    problems.append(
                        f"#{run.cmd.id} {run.cmd.op} used {share:.0%} of a CPU for {w1 - w0:.0f}s"
                    )
            dl = run.cmd.deadline
            if dl is not None and now > dl and not run.flagged_hung:
                run.flagged_hung = True
                run.cmd.info["hung"] = True
                problems.append(
                    f"#{run.cmd.id} {run.cmd.op} still running {now - run.cmd.start:.0f}s "
                    f"after its start (deadline {dl - run.cmd.start:.0f}s)"
                )
        return ended, problems

    def _reap(self, run: Running, code: int) -> None:
        cmd = run.cmd
        if cmd.outcome == "running":
            outcome = f"exit {code}" if code >= 0 else f"signal {-code}"
            self.history.finish(cmd, outcome, code)
        out = run.log_path.with_suffix(".out")
        text = out.read_text(errors="replace") if out.exists() else ""
        with contextlib.suppress(ValueError):
            cmd.result = json.loads(text) if text.strip() else None
        # the group's other processes (a pool's members) go with it
        self.signal_group(run, signal.SIGKILL)
        self.done[cmd.id] = run

    def signal(self, run: Running, sig: int) -> None:
        """Send ``sig`` to the command's main process."""
        with contextlib.suppress(ProcessLookupError):
            run.proc.send_signal(sig)

    def signal_group(self, run: Running, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.proc.pid, sig)

    def wait(self, run: Running, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for ``run`` to end; its exit code or None."""
        try:
            code = run.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if run.cmd.id in self.running:
            del self.running[run.cmd.id]
            self._reap(run, code)
        return code

    def log_tail(self, run: Running, chars: int = 2000) -> str:
        try:
            return run.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill_all(self) -> None:
        """SIGCONT and SIGKILL every command's process group still running; reap them."""
        for run in list(self.running.values()):
            self.signal_group(run, signal.SIGCONT)
            self.signal_group(run, signal.SIGKILL)
        for run in list(self.running.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = run.proc.wait(timeout=30)
                if run.cmd.outcome == "running":
                    self.history.finish(run.cmd, "killed at the end", code)
            del self.running[run.cmd.id]
            self.done[run.cmd.id] = run
