"""`make bench` (second half): the worker's throughput, failover and memory, on a real server.

Everything runs against one embedded nats-server (file storage). These machines are shared
and noisy, so throughput figures are ratios to a baseline measured in the same round, with
the variants interleaved (rotated order) over several rounds; medians and min..max.

a. Throughput: one 16-partition stream with a backlog of BENCH_WORKER_N 100-byte records
   (published once with the OrderedPublisher); each variant reads the whole backlog.
     raw-ordered    nats-py ordered push consumer over all partitions, no-op callback: 1.00
     worker         one in-process Worker (fresh group each round), no-op handler, defaults;
                    timed from ``start()`` until the handler has seen all N
     worker-batch   the same with ``batch_handler=True``
     ack-pending-1  the per-message-ack design: one durable push consumer per partition,
                    ``ack_policy=explicit``, ``max_ack_pending=1``, ack after the no-op handler,
                    16 partitions at once; run on a subset (BENCH_ACK1_N) and compared by rate
   Goal: worker and worker-batch >= 1.9 x raw-ordered (issue 33; issue 19's was 1.0 x).
b. Failover, with worker PROCESSES started through the CLI (``--lease-ttl 2``) and the
   ``bench_handlers:Recorder`` handler logging every apply (wall time, member, partition,
   seq); a background publisher trickles ~BENCH_TRICKLE msg/s, round-robin over the
   partitions, so there is always something to apply.
     kill       SIGKILL an owner -> first apply by another member on one of its partitions
                (goal <= TTL + 1 s); "all" = until every one of its partitions was applied
     graceful   SIGTERM an owner -> the same (goal <= 0.5 s)
     join       start a member -> every partition owned again and the new member applied
                its first message; from the spawn (includes interpreter start-up) and from
                the moment the process printed "joined"
   Seconds (absolute: these are dominated by the TTL) and as a fraction of the TTL. Lines
   where a member logged a lost lease, fencing or a failure are reported; the apply log,
   audit log and member outputs are kept in ``.bench/worker-failover-logs/``.
b3. Re-deliveries per SIGKILL (``redelivery``, bench/redelivery.py): two CLI members drain
   BENCH_REDELIVERY_N records, one is SIGKILLed at a third; re-deliveries, the drain rate
   and commit writes/s, against the commit cadence before issue 19 in the same run.
c. Memory: one CLI worker process drains the backlog with a fresh group; its VmRSS is
   sampled every 0.5 s; RSS at 10 %, 50 %, 90 % of the drain and the max. "Flat" means
   max / RSS@10% < 1.3 (reported, not asserted).
d. Memory with 1 MB records: a worker in a child process with a slow handler (50 ms per
   message, so its buffers stay as full as their bounds allow) drains BENCH_BIG_N records
   (default 480, over 16 partitions) three times: 100-byte records (the baseline, measured
   in the same run), 1 MB records with the default ``max_buffer_bytes`` (64 MiB), and 1 MB
   records with the byte bound lifted (counts only: 2 x ``fetch_batch`` per partition, as
   before the bound existed). Peak VmRSS (every 0.1 s), as a ratio to the baseline.

Environment: BENCH_WORKER_N (default 1,000,000), BENCH_ROUNDS (3), BENCH_ACK1_N (50,000),
BENCH_FAILOVER_REPS (3), BENCH_TRICKLE (200 msg/s). ``--quick`` shrinks N, the rounds, the
subset and the repetitions; ``--sections throughput,failover,memory`` picks sections.
Writes ``.bench/worker.json`` (with the commit and a hash of the worker module measured).
The run time is dominated by section a (3 full reads of N per round) and c (one more): with
the defaults about 7.5 minutes on 2 cores at ~25k msg/s per worker (14 at ~10k msg/s);
BENCH_WORKER_N=500000 halves section a. A read that makes no progress for BENCH_STALL
seconds (default 20) is reported as stalled (rate up to the stall) instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import worker_common
from cluster_failover import print_server_loss, section_server_loss
from redelivery import print_redelivery, section_redelivery
from worker_common import (
    BACKLOG_STREAM,
    BENCH_DIR,
    PARTITIONS,
    PAYLOAD,
    Settings,
    connect,
    log,
    med,
    publish_backlog,
)
from worker_failover import print_failover, section_failover
from worker_memory import (
    _member_main,
    print_memory,
    print_memory_big,
    section_memory,
    section_memory_big,
)
from worker_throughput import print_throughput, section_throughput

from airflow_nats_ordered.core.stream import compiled
from airflow_nats_ordered.embedded.servers import NatsServer


def code_version() -> dict[str, Any]:
    """Which code was measured: the commit, whether the tree is dirty, and a hash of the
    core's modules (CLI processes import the files as they are when they start; the worker
    is spread over several of them)."""
    import hashlib

    import airflow_nats_ordered.core as core_pkg

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=10, cwd=BENCH_DIR
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    src = b"".join(p.read_bytes() for p in sorted(Path(core_pkg.__file__).parent.glob("*.py")))
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "worker_py_sha256": hashlib.sha256(src).hexdigest()[:12],
    }


async def amain(st: Settings, url: str, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "code": code_version(),
        "n": st.n,
        "rounds": st.rounds,
        "ack1_n": st.ack1_n,
        "partitions": PARTITIONS,
        "payload": PAYLOAD,
    }
    t_all = time.monotonic()
    prefix = None
    if st.sections & {"throughput", "memory"}:
        log(f"publishing a backlog of {st.n:,} records ...")
        nc = await connect(url)
        prefix = await publish_backlog(nc, BACKLOG_STREAM, st.n)
        await nc.close()
    if "throughput" in st.sections:
        assert prefix is not None
        t0 = time.monotonic()
        log("a. throughput")
        out["throughput"] = await section_throughput(url, prefix, st)
        print_throughput(out["throughput"], st)
        log(f"a. took {time.monotonic() - t0:.0f}s")
    if "failover" in st.sections:
        t0 = time.monotonic()
        log("b. failover")
        out["failover"] = await section_failover(url, work, st)
        print_failover(out["failover"])
        log(f"b. took {time.monotonic() - t0:.0f}s")
    if "server-loss" in st.sections:
        t0 = time.monotonic()
        log("b2. server loss on a 3-node cluster")
        out["server_loss"] = await section_server_loss(st.reps, st.trickle, log)
        print_server_loss(out["server_loss"])
        log(f"b2. took {time.monotonic() - t0:.0f}s")
    if "redelivery" in st.sections:
        t0 = time.monotonic()
        log("b3. re-deliveries per SIGKILL")
        rd_n = int(os.environ.get("BENCH_REDELIVERY_N", "50000" if st.n < 1_000_000 else "200000"))
        out["redelivery"] = await section_redelivery(worker_common, url, work, st.reps, rd_n)
        print_redelivery(out["redelivery"])
        log(f"b3. took {time.monotonic() - t0:.0f}s")
    if "memory" in st.sections:
        t0 = time.monotonic()
        log("c. memory")
        out["memory"] = await section_memory(url, work, st)
        raw = None
        if "throughput" in out:
            raw = med(out["throughput"]["rates"]["raw-ordered"])
        print_memory(out["memory"], raw)
        log(f"c. took {time.monotonic() - t0:.0f}s")
    if "memory-1mb" in st.sections:
        t0 = time.monotonic()
        log("d. memory with 1 MB records")
        out["memory_1mb"] = await section_memory_big(url, work, st)
        print_memory_big(out["memory_1mb"])
        log(f"d. took {time.monotonic() - t0:.0f}s")
    out["elapsed"] = time.monotonic() - t_all
    out["code_at_end"] = code_version()
    c0, c1 = out["code"], out["code_at_end"]
    print(
        f"\ncode: {c0['commit']}{' (dirty)' if c0['dirty'] else ''}, "
        f"worker.py {c0['worker_py_sha256']}"
        + (
            f"; CHANGED during the run to {c1['worker_py_sha256']} (CLI workers started "
            "later run the new file)"
            if c1["worker_py_sha256"] != c0["worker_py_sha256"]
            else ""
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--member"]:  # a child process of section d.
        url, stream, group, progress, bound = args[1:6]
        asyncio.run(_member_main(url, stream, group, progress, int(bound)))
        return 0
    st = Settings.from_args(argv)
    with tempfile.TemporaryDirectory(prefix="wbench-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        with NatsServer(Path(tmp) / "nats") as srv:
            worker_common.SERVER_PID = srv.pid  # for the CPU figures of section b3
            log(f"nats-server {srv.url}; sections {sorted(st.sections)}; N={st.n:,}")
            # which twins of the compiled fast path this run measures (issue 33, goal 4)
            log(f"compiled fast path: {compiled.status() or 'none loaded'}")
            out = asyncio.run(amain(st, srv.url, work))
    dest = Path(".bench")
    dest.mkdir(exist_ok=True)
    (dest / "worker.json").write_text(json.dumps(out, indent=2))
    log(f"done in {out['elapsed']:.0f}s; wrote {dest / 'worker.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
