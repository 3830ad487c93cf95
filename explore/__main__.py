"""``python -m explore``: run the explorer for one or several seeds (see docs/explore.md).

Exit 0 when no seed found a violation, 1 otherwise; each failing seed prints its
violations, its history and the command that replays it.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from .generator import OPERATIONS
from .known import KNOWN_DEFECTS, parse_skip
from .nemesis import FAULTS
from .run import Explorer, Options, Result

#: the seeds `make explore` runs without SEED
DEFAULT_SEEDS = (1, 2, 3)


def _names(text: str, known: Mapping[str, object], what: str) -> frozenset[str]:
    if text == "all":
        return frozenset(known)
    if text == "none":
        return frozenset()
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(known))
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return names


class Interrupted(BaseException):
    """SIGINT or SIGTERM: stop exploring (the run's clean-up still runs)."""


def _interrupt(sig: int, _frame: object) -> None:
    raise Interrupted(f"interrupted by {signal.Signals(sig).name}")


def replay_command(r: Result, opts: Options, argv_extra: list[str]) -> str:
    minutes = f"{opts.seconds / 60:g}"
    extra = " ".join(argv_extra)
    return (
        f".venv/bin/python -m explore --seed {r.seed} --minutes {minutes} {extra}".strip()
        + f"   (or: make explore SEED={r.seed} MINUTES={minutes}"
        + (f' EXPLORE_ARGS="{extra}")' if extra else ")")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m explore", description=__doc__)
    ap.add_argument("--seed", type=int, action="append", help="a seed (repeatable)")
    ap.add_argument("--seeds", help=f"comma list of seeds (default: {DEFAULT_SEEDS})")
    ap.add_argument("--minutes", type=float, default=1.0, help="chaos phase per seed")
    ap.add_argument("--cluster", action="store_true", help="a 3-node cluster, leader kills")
    ap.add_argument(
        "--least-privilege",
        action="store_true",
        help="accounts and one user per role: every process connects with exactly its "
        "role's permissions (nats-ordered permissions); any refusal is a violation",
    )
    ap.add_argument(
        "--global-order",
        action="store_true",
        help="every publish stamps a global sequence (publish --global-order, one at a time); "
        "global-order readers (group gg) join and leave; no repartition, no dead-letter "
        "commands (see docs/explore.md)",
    )
    ap.add_argument(
        "--skip-known",
        default="all",
        help="known defects whose triggers are turned off: all (default), none, or names: "
        + ", ".join(KNOWN_DEFECTS),
    )
    ap.add_argument(
        "--ops", default="all", help="operations: all or names: " + ", ".join(OPERATIONS)
    )
    ap.add_argument(
        "--faults", default="all", help="faults: all, none or names: " + ", ".join(FAULTS)
    )
    ap.add_argument("--fault-rate", type=float, default=0.12, help="faults per second")
    ap.add_argument("--workdir", type=Path, help="keep every run's files here")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs of passing seeds")
    args = ap.parse_args(argv)
    seeds = list(args.seed or [])
    if args.seeds:
        seeds += [int(s) for s in args.seeds.split(",") if s.strip()]
    seeds = seeds or list(DEFAULT_SEEDS)
    try:
        skip = parse_skip(args.skip_known)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    extra = []
    if args.cluster:
        extra.append("--cluster")
    if args.least_privilege:
        extra.append("--least-privilege")
    if args.global_order:
        extra.append("--global-order")
    if args.skip_known != "all":
        extra.append(f"--skip-known {args.skip_known}")
    if args.ops != "all":
        extra.append(f"--ops {args.ops}")
    if args.faults != "all":
        extra.append(f"--faults {args.faults}")
    if args.fault_rate != 0.12:
        extra.append(f"--fault-rate {args.fault_rate}")
    # SIGTERM/SIGINT stop the run through its clean-up (every process it started is killed):
    # an exception raised here, not Python's or asyncio's default handling (asyncio.run
    # turns a SIGINT into a cancellation that a read in flight may absorb)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="nats-ordered-explore-"))
    failed = 0
    total = time.monotonic()
    for seed in seeds:
        opts = Options(
            seed=seed,
            seconds=args.minutes * 60,
            workdir=base / f"seed-{seed}",
            cluster=args.cluster,
            skip_known=skip,
            ops=_names(args.ops, OPERATIONS, "operation(s)"),
            faults=_names(args.faults, FAULTS, "fault(s)"),
            fault_rate=args.fault_rate,
            least_privilege=args.least_privilege,
            global_order=args.global_order,
        )
        print(f"explore: seed {seed}, {args.minutes:g} min ...", flush=True)
        try:
            result = Explorer(opts).run()
        except Interrupted as exc:
            print(f"explore: seed {seed} {exc}; every process it started was stopped")
            return 130
        ops = ", ".join(f"{k} {v}" for k, v in sorted(result.counts.items()))
        if result.violations:
            failed += 1
            print(f"\nexplore: seed {seed} FAILED after {result.elapsed:.0f}s ({ops})")
            for v in result.violations:
                print(f"  VIOLATION {v}")
            print("\nhistory (times in s since the start):")
            print(result.history.render(limit=150))
            print(f"\nfiles: {result.workdir} (history.json, logs/, sink.db)")
            print(f"replay: {replay_command(result, opts, extra)}\n", flush=True)
        else:
            print(f"explore: seed {seed} ok in {result.elapsed:.0f}s ({ops})", flush=True)
            if not args.keep and not args.workdir:
                shutil.rmtree(result.workdir, ignore_errors=True)
    print(
        f"explore: {len(seeds)} seed(s), {failed} failed, {time.monotonic() - total:.0f}s"
        f"; known defects skipped: {', '.join(sorted(skip)) or 'none'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
