"""CPU seconds of this process and its descendants, by role, from ``/proc`` (Linux).

Roles: ``driver`` (this Python process), ``jvm`` (a ``java`` child: Spark's driver and
executor threads, JIT compilers, GC), ``py-workers`` (Spark's Python workers: children of
``pyspark.daemon``, the routing UDF's and the writer tasks' alike; workers that exited are
counted through the daemon's reaped children), ``nats-server``. :func:`jit` is the JVM's
JIT compiler threads alone (part of ``jvm``). Sample before and after, subtract
(:func:`spent`): CPU per write, which the machine's load changes much less than wall time.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, int, float, float] | None:
    """(comm, ppid, own CPU s, reaped children's CPU s) of one /proc stat file."""
    try:
        raw = path.read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    f = raw[raw.rindex(")") + 2 :].split()
    return comm, int(f[1]), (int(f[11]) + int(f[12])) / TICK, (int(f[13]) + int(f[14])) / TICK


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def sample() -> dict[str, float]:
    """Cumulative CPU seconds by role of this process tree, and ``jit`` (see module doc)."""
    procs: dict[int, tuple[str, int, float, float]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (s := _stat(d / "stat")) is not None:
            procs[int(d.name)] = s
    me = os.getpid()
    tree = {me}
    grew = True
    while grew:
        grew = False
        for pid, (_, ppid, _, _) in procs.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    out = {"driver": 0.0, "jvm": 0.0, "py-workers": 0.0, "nats-server": 0.0, "jit": 0.0}
    for pid in tree:
        comm, ppid, own, reaped = procs[pid]
        cmd = _cmdline(pid)
        if pid == me:
            out["driver"] += own
        elif comm == "java" or cmd.startswith("java") or "/java " in cmd:
            out["jvm"] += own
            for t in Path(f"/proc/{pid}/task").glob("*/stat"):
                ts = _stat(t)
                if ts is not None and "Compiler" in ts[0]:
                    out["jit"] += ts[2]
        elif "pyspark.daemon" in cmd and procs.get(ppid, ("",))[0] == "java":
            out["py-workers"] += own + reaped  # the daemon, and the workers it reaped
        elif "pyspark" in cmd:
            out["py-workers"] += own
        elif "nats-server" in comm or "nats-server" in cmd:
            out["nats-server"] += own
    return out


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds by role between two samples, and ``total`` (``jit`` is in ``jvm``)."""
    d = {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) for k in after}
    d["total"] = sum(v for k, v in d.items() if k != "jit")
    return d
