"""The Spark sink against the core publisher, A/B across code trees (issue 33, goal 3): for
each round, one child process per code tree (alternated, their order rotated per round,
``PYTHONPATH`` = the tree, which Spark's Python workers inherit) runs this checkout's
bench/spark_bench.py (its own SparkSession and warm-up write, then ``--inner`` rounds of the
core publisher and ``write_ordered`` on the same rows). Printed per tree: the medians of
the rate ratio spark / core and of the CPU ratio core / spark, and the CPU seconds per
write by process (the JVM, Spark's Python workers, nats-server), as bench/read_ab.py and
bench/publish_ab.py do for the worker and the publisher.

    python bench/spark_ab.py [--n 200000] [--rounds 2] [--inner 2] TREE [TREE ...]

A tree is a checkout's root (e.g. ``git archive`` of a commit unpacked into /tmp). Each
child starts a JVM and writes the rows once to warm it (about 30 s) before its rounds. Not
part of ``make bench`` (bench/spark_bench.py prints the goal's ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROLES = ("driver", "jvm", "jit", "py-workers", "nats-server", "total")


def child(tree: Path, n: int, inner: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spark-ab-") as cwd:
        env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "PYSPARK_PYTHON": sys.executable,
            "BENCH_SPARK_N": str(n),
            "BENCH_ROUNDS": str(inner),
        }
        p = subprocess.run(
            [sys.executable, str(HERE / "spark_bench.py")],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        if p.returncode:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
            raise SystemExit(f"{tree}: spark_bench.py exited {p.returncode}")
        return json.loads((Path(cwd) / ".bench" / "spark.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inner", type=int, default=2)
    ap.add_argument("trees", nargs="+", type=Path)
    a = ap.parse_args()
    trees = [t.resolve() for t in a.trees]
    got: dict[Path, list[dict[str, Any]]] = {t: [] for t in trees}
    for rnd in range(a.rounds):
        order = trees[rnd % len(trees) :] + trees[: rnd % len(trees)]
        for tree in order:
            res = child(tree, a.n, a.inner)
            got[tree].append(res)
            print(
                f"round {rnd + 1} {tree.name}: ratios {[round(r, 2) for r in res['ratios']]}, "
                f"CPU ratios {[round(r, 2) for r in res['cpu_ratios']]}; "
                f"load {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
                flush=True,
            )
    print(f"\n{a.n:,} rows, {a.rounds} x {a.inner} rounds per tree")
    for tree, runs in got.items():
        ratios = [r for run in runs for r in run["ratios"]]
        cpu_ratios = [r for run in runs for r in run["cpu_ratios"]]
        cpu = {
            v: {
                k: statistics.median(d.get(k, 0.0) for run in runs for d in run["cpu_s"][v])
                for k in ROLES
            }
            for v in ("core", "spark")
        }
        text = {
            v: ", ".join(f"{k} {cpu[v][k]:.2f}" for k in ROLES if cpu[v][k] >= 0.005) for v in cpu
        }
        print(
            f"{tree.name}: spark/core {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}..{max(ratios):.2f}); CPU ratio core/spark "
            f"{statistics.median(cpu_ratios):.2f} ({min(cpu_ratios):.2f}..{max(cpu_ratios):.2f})"
            f"\n   CPU s per write: core {text['core']}; spark {text['spark']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
