"""The worker's read path against nats-py's raw ordered consumer, A/B across code trees
(issue 33, goals 1 and 5): one embedded nats-server, one backlog, then for each round one
child process per code tree (alternated, ``PYTHONPATH`` = the tree) that reads the backlog
with ``raw-ordered`` and ``worker`` (bench/worker_throughput.py's variants, their order
rotated per round) and prints rate and CPU per record (this process + nats-server).

    python bench/read_ab.py [--n 300000] [--rounds 3] [--profile DIR] TREE [TREE ...]

``--profile DIR``: each child also runs the worker once more under cProfile and writes
``DIR/<tree name>.prof`` (then the top entries: ``python -m pstats``). A tree is a
checkout's root (e.g. ``git archive`` of a commit unpacked into /tmp). Not part of
``make bench`` (which prints the same ratio in section a of bench/worker_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def child(url: str, prefix: str, n: int, rnd: int, profile: str | None) -> None:
    import worker_common
    import worker_throughput as wt

    worker_common.SERVER_PID = int(os.environ["READ_AB_SERVER_PID"])
    out: dict[str, dict[str, float]] = {}
    order = ["raw-ordered", "worker"] if rnd % 2 == 0 else ["worker", "raw-ordered"]
    variants = {"raw-ordered": wt.v_raw_ordered, "worker": wt.v_worker}
    for name in order:
        await asyncio.sleep(0.5)
        wt.WINDOW.clear()
        run = await variants[name](url, prefix, n, rnd)
        per = 1e6 / max(1, run.count)
        out[name] = {
            "rate": run.rate,
            "count": run.count,
            "cpu_us": wt.WINDOW["client"] * per,
            "server_us": wt.WINDOW["server"] * per,
        }
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        await wt.v_worker(url, prefix, n, 100 + rnd)
        prof.disable()
        prof.dump_stats(profile)
    print(json.dumps(out), flush=True)


def loadavg() -> float:
    return os.getloadavg()[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--child", nargs=4, metavar=("URL", "PREFIX", "N", "ROUND"))
    ap.add_argument("--child-profile", default=None)
    ap.add_argument("trees", nargs="*")
    a = ap.parse_args()
    if a.child:
        url, prefix, n, rnd = a.child
        asyncio.run(child(url, prefix, int(n), int(rnd), a.child_profile))
        return 0

    sys.path.insert(0, str(HERE))
    from worker_common import connect, publish_backlog

    from airflow_nats_ordered.embedded.servers import NatsServer

    trees = [str(Path(t).resolve()) for t in a.trees] or [str(HERE.parent)]
    results: dict[str, list[dict[str, dict[str, float]]]] = {t: [] for t in trees}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="readab-") as tmp, NatsServer(Path(tmp) / "n") as srv:

        async def backlog() -> str:
            nc = await connect(srv.url)
            prefix = await publish_backlog(nc, "WBENCH", a.n)
            await nc.close()
            return prefix

        prefix = asyncio.run(backlog())
        for rnd in range(a.rounds):
            order = trees if rnd % 2 == 0 else trees[::-1]
            for tree in order:
                env = dict(os.environ, PYTHONPATH=f"{tree}:{HERE}", READ_AB_SERVER_PID=str(srv.pid))
                cmd = [sys.executable, str(HERE / "read_ab.py"), "--child", srv.url, prefix]
                cmd += [str(a.n), str(rnd)]
                if a.profile and rnd == 0:
                    Path(a.profile).mkdir(parents=True, exist_ok=True)
                    cmd += ["--child-profile", f"{a.profile}/{Path(tree).name}.prof"]
                loads.append(loadavg())
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
                if p.returncode:
                    print(p.stderr, file=sys.stderr)
                    return 1
                r = json.loads(p.stdout.strip().splitlines()[-1])
                results[tree].append(r)
                w, raw = r["worker"], r["raw-ordered"]
                print(
                    f"round {rnd + 1} {Path(tree).name:12s} worker {w['rate']:>8,.0f}/s "
                    f"{w['cpu_us']:5.2f}+{w['server_us']:4.2f} us  raw {raw['rate']:>8,.0f}/s "
                    f"{raw['cpu_us']:5.2f}+{raw['server_us']:4.2f} us  "
                    f"ratio {w['rate'] / raw['rate']:.2f}  load {loads[-1]:.2f}",
                    flush=True,
                )
    print(f"\nmedians of {a.rounds} rounds, N={a.n:,}, load {min(loads):.2f}..{max(loads):.2f}")
    for tree, rs in results.items():

        def m(v: str, k: str, rs: list[dict[str, dict[str, float]]] = rs) -> float:
            return statistics.median(r[v][k] for r in rs)

        ratio = statistics.median(r["worker"]["rate"] / r["raw-ordered"]["rate"] for r in rs)
        print(
            f"{Path(tree).name:12s} worker {m('worker', 'rate'):>8,.0f}/s "
            f"{m('worker', 'cpu_us'):5.2f}+{m('worker', 'server_us'):4.2f} us  "
            f"raw {m('raw-ordered', 'rate'):>8,.0f}/s {m('raw-ordered', 'cpu_us'):5.2f}+"
            f"{m('raw-ordered', 'server_us'):4.2f} us  ratio {ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print(f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
