"""The ordered publisher against raw-wire, A/B across code trees (issue 33, goals 2 and 5):
one embedded nats-server, then for each round one child process per code tree (alternated,
``PYTHONPATH`` = the tree) that runs bench/run.py's ``raw-wire`` and ``ordered`` variants
on the same records (their order rotated per round) and prints rate and CPU per record
(this process + nats-server), as bench/read_ab.py does for the worker.

    python bench/publish_ab.py [--n 200000] [--rounds 3] [--profile DIR] TREE [TREE ...]

``--profile DIR``: in round 1 each child also runs the publisher once more under cProfile
and writes ``DIR/<tree name>.prof``. A tree is a checkout's root (e.g. ``git archive`` of a
commit unpacked into /tmp). Not part of ``make bench`` (bench/run.py prints the same ratio).
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


async def child(url: str, n: int, rnd: int, profile: str | None) -> None:
    import nats
    import run

    run.SERVER_PID = int(os.environ["PUB_AB_SERVER_PID"])
    run.N = n
    nc = await nats.connect(url, pending_size=8 * 1024 * 1024)
    out: dict[str, dict[str, float]] = {}
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

    names = ["raw-wire", "fastbatch", "ordered"]
    if hasattr(OrderedPublisher, "publish_many"):  # a tree with the bulk entry
        names.append("ordered-many")
    order = names[rnd % len(names) :] + names[: rnd % len(names)]
    for name in order:
        await asyncio.sleep(0.3)
        rate, stored, cpu_us, server_us = await run.run_variant(nc, name, rnd)
        out[name] = {"rate": rate, "stored": stored, "cpu_us": cpu_us, "server_us": server_us}
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        await run.run_variant(nc, "ordered", 100 + rnd)
        prof.disable()
        prof.dump_stats(profile)
    await nc.close()
    print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--child", nargs=3, metavar=("URL", "N", "ROUND"))
    ap.add_argument("--child-profile", default=None)
    ap.add_argument("trees", nargs="*")
    a = ap.parse_args()
    if a.child:
        url, n, rnd = a.child
        asyncio.run(child(url, int(n), int(rnd), a.child_profile))
        return 0

    from airflow_nats_ordered.embedded.servers import NatsServer

    trees = [str(Path(t).resolve()) for t in a.trees] or [str(HERE.parent)]
    results: dict[str, list[dict[str, dict[str, float]]]] = {t: [] for t in trees}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="pubab-") as tmp, NatsServer(Path(tmp) / "n") as srv:
        for rnd in range(a.rounds):
            order = trees if rnd % 2 == 0 else trees[::-1]
            for tree in order:
                env = dict(os.environ, PYTHONPATH=f"{tree}:{HERE}", PUB_AB_SERVER_PID=str(srv.pid))
                cmd = [sys.executable, str(HERE / "publish_ab.py"), "--child", srv.url]
                cmd += [str(a.n), str(rnd)]
                if a.profile and rnd == 0:
                    Path(a.profile).mkdir(parents=True, exist_ok=True)
                    cmd += ["--child-profile", f"{a.profile}/{Path(tree).name}.prof"]
                loads.append(os.getloadavg()[0])
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
                if p.returncode:
                    print(p.stderr, file=sys.stderr)
                    return 1
                r = json.loads(p.stdout.strip().splitlines()[-1])
                results[tree].append(r)
                o, w, f = r["ordered"], r["raw-wire"], r["fastbatch"]
                print(
                    f"round {rnd + 1} {Path(tree).name:12s} ordered {o['rate']:>8,.0f}/s "
                    f"{o['cpu_us']:5.2f}+{o['server_us']:4.2f} us  raw-wire {w['rate']:>8,.0f}/s "
                    f"{w['cpu_us']:5.2f}+{w['server_us']:4.2f} us (stored {w['stored']:,.0f})  "
                    f"fast batch {f['rate']:>8,.0f}/s {f['cpu_us']:5.2f}+{f['server_us']:4.2f} us  "
                    f"ratio {o['rate'] / w['rate']:.2f}  load {loads[-1]:.2f}",
                    flush=True,
                )
                if "ordered-many" in r:
                    b = r["ordered-many"]
                    print(
                        f"        {Path(tree).name:12s} ordered-many {b['rate']:>8,.0f}/s "
                        f"{b['cpu_us']:5.2f}+{b['server_us']:4.2f} us  "
                        f"ratio {b['rate'] / w['rate']:.2f}",
                        flush=True,
                    )
    print(f"\nmedians of {a.rounds} rounds, N={a.n:,}, load {min(loads):.2f}..{max(loads):.2f}")
    print("(rounds where the ack-less raw-wire lost messages are left out of its figures)")
    for tree, rs in results.items():
        ok = [r for r in rs if r["raw-wire"]["stored"] == a.n] or rs

        def m(
            v: str,
            k: str,
            rs: list[dict[str, dict[str, float]]] = rs,
            ok: list[dict[str, dict[str, float]]] = ok,
        ) -> float:
            use = ok if v == "raw-wire" else rs
            return statistics.median(r[v][k] for r in use)

        ratio = statistics.median(r["ordered"]["rate"] / r["raw-wire"]["rate"] for r in ok)
        print(
            f"{Path(tree).name:12s} ordered {m('ordered', 'rate'):>8,.0f}/s "
            f"{m('ordered', 'cpu_us'):5.2f}+{m('ordered', 'server_us'):4.2f} us  "
            f"raw-wire {m('raw-wire', 'rate'):>8,.0f}/s {m('raw-wire', 'cpu_us'):5.2f}+"
            f"{m('raw-wire', 'server_us'):4.2f} us  fast batch {m('fastbatch', 'rate'):>8,.0f}/s "
            f"{m('fastbatch', 'cpu_us'):5.2f}+{m('fastbatch', 'server_us'):4.2f} us  "
            f"ordered / raw-wire {ratio:.2f}"
        )
        if all("ordered-many" in r for r in rs):
            many = statistics.median(r["ordered-many"]["rate"] / r["raw-wire"]["rate"] for r in ok)
            print(
                f"{Path(tree).name:12s} ordered-many {m('ordered-many', 'rate'):>8,.0f}/s "
                f"{m('ordered-many', 'cpu_us'):5.2f}+{m('ordered-many', 'server_us'):4.2f} us  "
                f"ordered-many / raw-wire {many:.2f}"
            )
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print(f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
