"""`make demo`: ``flights_ordered_pipeline`` through a real Airflow, Spark and worker pool.

``python -m airflow_nats_ordered.demo`` (or ``.demo.pipeline``), from a source checkout:
``--dags`` is the repository's ``dags/`` folder by default.

1. a throw-away Airflow home under ``.demo/`` (SQLite metadata DB, LocalExecutor), the
   repository's ``dags/`` as its DAGs folder, and an embedded nats-server;
2. the worker pool as a deployment runs it: ``nats-ordered pool --size 3 --conn-id
   nats_default --handler flights.handlers:AircraftTotals`` with ``PYTHONPATH=dags``;
3. the real Airflow services - ``api-server`` (the task execution API), ``scheduler``,
   ``dag-processor`` and ``triggerer`` (the drain sensor defers to it) - then unpauses the
   DAG: the scheduler catches up day by day (one active run; each day is published by
   ``spark-submit`` (local Spark), drained and verified against the Spark reference);
4. while the second day runs, SIGKILLs a pool member (the pool restarts it; its partitions
   move after the lease TTL);
5. re-runs the first day with ``airflow backfill create --reprocess-behavior completed`` and
   checks that nothing changes (stream, sink);
6. prints the per-day table and "verified" only if every day's totals matched the
   reference and the re-run changed nothing.

``--days N`` runs the first N days of 2013 (default 2: about 5 minutes here); ``--year``
all 365 (hours: a spark-submit per day).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from airflow_nats_ordered.core.connection.api import jetstream

DAG_ID = "flights_ordered_pipeline"
STREAM = "FLIGHTS"
GROUP = "aircraft-totals"
#: the repository's dags folder: the DAGs and their handler are not in the installed package
DAGS = Path(__file__).resolve().parents[2] / "dags"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Services:
    """Processes started by the demo, each in its own process group; stopped in reverse."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs, self.env = logs, env
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *cmd: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append((name, p))
        return p

    def stop(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for name, p in reversed(self.procs):
            try:
                codes[name] = p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes[name] = p.wait(10)
        return codes


def airflow(env: dict[str, str], *args: str, timeout: float = 180) -> str:
    r = subprocess.run(
        [str(BIN / "airflow"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"airflow {' '.join(args)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return r.stdout


def query(db: Path, sql: str, *params: Any) -> list[tuple]:
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    except sqlite3.OperationalError:  # tables not created yet
        return []
    finally:
        con.close()


def runs(meta: Path) -> dict[str, dict[str, Any]]:
    """Per logical day: run state and task states."""
    out: dict[str, dict[str, Any]] = {}
    for run_id, logical, state in query(
        meta, "SELECT run_id, logical_date, state FROM dag_run WHERE dag_id = ?", DAG_ID
    ):
        day = str(logical)[:10]
        tis = dict(
            query(
                meta,
                "SELECT task_id, state FROM task_instance WHERE dag_id = ? AND run_id = ?",
                DAG_ID,
                run_id,
            )
        )
        out[day] = {"run_id": run_id, "state": state, "tasks": tis}
    return out


def xcom(meta: Path, run_id: str, task_id: str) -> Any:
    rows = query(
        meta,
        "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = ? AND "
        "key = 'return_value'",
        DAG_ID,
        run_id,
        task_id,
    )
    if not rows or rows[0][0] is None:
        return None
    value = rows[0][0]
    value = json.loads(value) if isinstance(value, str | bytes) else value
    return json.loads(value) if isinstance(value, str) else value


def times(meta: Path, run_id: str) -> dict[str, tuple[str | None, str | None]]:
    return {
        t: (s, e)
        for t, s, e in query(
            meta,
            "SELECT task_id, start_date, end_date FROM task_instance WHERE dag_id = ? AND "
            "run_id = ?",
            DAG_ID,
            run_id,
        )
    }


def _ts(text: str | None) -> float | None:
    return dt.datetime.fromisoformat(text).timestamp() if text else None


def day_row(meta: Path, day: str, rerun: bool = False) -> tuple[str, bool]:
    """One line of the per-day table, and whether the day was verified."""
    r = runs(meta)[day]
    pub = xcom(meta, r["run_id"], "publish") or {}
    ver = xcom(meta, r["run_id"], "verify") or {}
    t = times(meta, r["run_id"])
    p_end, d_end = _ts(t.get("publish", (None, None))[1]), _ts(t.get("drained", (None, None))[1])
    drained = f"{d_end - p_end:.1f}" if p_end and d_end else "?"
    ok = bool(ver.get("verified"))
    label = f"{day} re-run" if rerun else day
    sent = "0 (ledger)" if rerun else str(pub.get("acked", "?"))
    line = (
        f"{label:<18}{sent:>11}{pub.get('refused', '?'):>9}{drained:>14}  "
        f"{'verified' if ok else 'NOT verified'} ({ver.get('aircraft', '?')} aircraft, "
        f"{ver.get('flights', '?')} flights to date)"
    )
    return line, ok


def sink_digest(db: Path) -> tuple[int, str]:
    """(flights applied, a digest of every aircraft's totals and running values)."""
    with sqlite3.connect(db, timeout=30) as conn:
        rows = conn.execute("SELECT * FROM flight_running ORDER BY tailnum, n").fetchall()
        totals = conn.execute("SELECT * FROM aircraft ORDER BY tailnum").fetchall()
    return len(rows), hashlib.sha256(repr((rows, totals)).encode()).hexdigest()[:16]


async def _last_seq(url: str) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        return (await jetstream(nc).stream_info(STREAM)).state.last_seq
    finally:
        await nc.close()


def members(pool_pid: int) -> list[int]:
    """The pool's member processes (its children)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pool_pid}/task").glob("*"):
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def wait_runs(
    meta: Path, days: list[str], deadline: float, on_change: Any = None
) -> dict[str, dict[str, Any]]:
    """Wait until every day's run succeeded (or one failed); print progress."""
    shown: dict[str, str] = {}
    while True:
        now = runs(meta)
        for day in days:
            r = now.get(day)
            if r is None:
                continue
            line = f"{r['state']}: " + ", ".join(
                f"{t}={s}" for t, s in sorted(r["tasks"].items()) if s
            )
            if shown.get(day) != line:
                shown[day] = line
                print(f"   {day} {line}", flush=True)
                if on_change:
                    on_change(day, r)
        if all(now.get(d, {}).get("state") == "success" for d in days):
            return now
        failed = [d for d in days if now.get(d, {}).get("state") == "failed"]
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"runs failed or timed out: {failed or 'timeout'}; see the logs")
        time.sleep(1)


def main(
    argv: list[str] | None = None, prog: str = "python -m airflow_nats_ordered.demo.pipeline"
) -> int:
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--workdir", default=".demo", help="server store, Airflow home, sink, logs")
    ap.add_argument("--days", type=int, default=2, help="days of 2013 to run (default 2)")
    ap.add_argument("--year", action="store_true", help="all 365 days of 2013")
    ap.add_argument("--timeout", type=float, default=None, help="seconds (default: per day)")
    ap.add_argument(
        "--dags", type=Path, default=DAGS, help="the dags folder (default: the checkout's dags/)"
    )
    args = ap.parse_args(argv)
    dags = args.dags.resolve()
    if not (dags / "flights" / "handlers.py").is_file():
        ap.error(f"{dags} has no flights/handlers.py: pass the repository's dags folder")
    n_days = 365 if args.year else args.days
    if n_days < 2:
        ap.error("--days must be at least 2 (a member is killed during the second day)")
    first = dt.date(2013, 1, 1)
    days = [(first + dt.timedelta(days=i)).isoformat() for i in range(n_days)]
    rerun = days[0]

    from airflow_nats_ordered.embedded.servers import NatsServer

    t0 = time.monotonic()
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    home, sink = work / "airflow", work / "totals.db"
    meta = home / "airflow.db"
    with NatsServer(work / "nats") as server:
        api_port = free_port()
        env = dict(
            os.environ,
            AIRFLOW_HOME=str(home),
            AIRFLOW__CORE__DAGS_FOLDER=str(dags),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="True",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{api_port}/execution/",
            AIRFLOW__API__PORT=str(api_port),
            AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
            AIRFLOW_CONN_NATS_DEFAULT=json.dumps(
                {"conn_type": "nats", "extra": {"servers": server.url}}
            ),
            AIRFLOW_CONN_SPARK_DEFAULT=json.dumps({"conn_type": "spark", "host": "local[2]"}),
            AIRCRAFT_TOTALS_DB=str(sink),
            FLIGHTS_STREAM=STREAM,
            FLIGHTS_GROUP=GROUP,
            FLIGHTS_LAST_DAY=days[-1],
            PYTHONPATH=os.pathsep.join(p for p in (str(dags), os.environ.get("PYTHONPATH")) if p),
            PYSPARK_PYTHON=sys.executable,
            PYTHONUNBUFFERED="1",
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        print(f"== embedded nats-server {server.url}; Airflow home {home} (SQLite)")
        airflow(env, "db", "migrate", timeout=300)
        print(f"   airflow db migrate: {time.monotonic() - t0:.0f}s")
        cli = [sys.executable, "-m", "airflow_nats_ordered.cli"]
        subprocess.run(
            [*cli, "provision", "--stream", STREAM, "--partitions", "16",
             "--duplicate-window", "1h", "--conn-id", "nats_default"],
            env=env, check=True,
        )  # fmt: skip
        svc = Services(work / "logs", env)
        ok = False
        try:
            metrics = free_port()
            pool = svc.start(
                "pool",
                *cli,
                *("pool", "--size", "3", "--conn-id", "nats_default", "--stream", STREAM),
                *("--group", GROUP, "--handler", "flights.handlers:AircraftTotals"),
                *("--batch-handler", "--lease-ttl", "3", "--metrics-port", str(metrics)),
            )
            print(
                f"== worker pool: nats-ordered pool --size 3 --handler "
                f"flights.handlers:AircraftTotals (PYTHONPATH=dags), metrics on :{metrics}"
            )
            af = str(BIN / "airflow")
            svc.start("api-server", af, "api-server", "--port", str(api_port))
            svc.start("scheduler", af, "scheduler", "--skip-serve-logs")
            svc.start("dag-processor", af, "dag-processor")
            svc.start("triggerer", af, "triggerer", "--skip-serve-logs")
            print("== Airflow: api-server, scheduler, dag-processor, triggerer (LocalExecutor)")
            print(
                f"== the pipeline view, while the demo runs: http://127.0.0.1:{api_port}"
                f"/nats-ordered/?conn=nats_default&stream={STREAM}&group={GROUP} (in Airflow's "
                "UI: Browse > NATS pipelines; sign in as admin, password in "
                f"{home / 'simple_auth_manager_passwords.json.generated'})"
            )
            deadline = time.monotonic() + 120
            while not query(meta, "SELECT 1 FROM dag WHERE dag_id = ?", DAG_ID):
                if time.monotonic() > deadline:
                    raise RuntimeError("the dag-processor did not load the DAG: see logs/")
                time.sleep(1)
            airflow(env, "dags", "unpause", DAG_ID)
            print(f"== unpaused {DAG_ID}: catch-up {days[0]} .. {days[-1]}, one run at a time")

            killed: list[str] = []

            def kill_midway(day: str, r: dict[str, Any]) -> None:
                if not killed and day == days[1] and r["tasks"].get("publish") == "running":
                    victim = members(pool.pid)[0]
                    os.kill(victim, signal.SIGKILL)
                    killed.append(day)
                    print(
                        f"   SIGKILL pool member pid {victim} while {day} publishes; the pool "
                        "restarts it, its partitions move after the lease TTL (3 s)"
                    )

            # a bound on a hang, not a speed: a shared or loaded machine runs a day in minutes
            budget = args.timeout or 300 + 300 * n_days
            wait_runs(meta, days, time.monotonic() + budget, kill_midway)
            table = [day_row(meta, day) for day in days]
            seq_before = asyncio.run(_last_seq(server.url))
            sink_before = sink_digest(sink)

            print(f"\n$ airflow backfill create --dag-id {DAG_ID} --from-date {rerun} "
                  f"--to-date {rerun} --reprocess-behavior completed")  # fmt: skip
            rerun_t0 = time.time()
            airflow(env, "backfill", "create", "--dag-id", DAG_ID, "--from-date", rerun,
                    "--to-date", rerun, "--reprocess-behavior", "completed")  # fmt: skip
            deadline = time.monotonic() + 600
            while True:
                r = runs(meta).get(rerun, {})
                end = times(meta, r.get("run_id", "")).get("verify", (None, None))[1]
                if r.get("state") == "success" and (_ts(end) or 0) > rerun_t0:
                    break
                if r.get("state") == "failed" or time.monotonic() > deadline:
                    raise RuntimeError(f"the re-run of {rerun} did not succeed: {r}")
                time.sleep(1)
            seq_after = asyncio.run(_last_seq(server.url))
            sink_after = sink_digest(sink)
            unchanged = seq_after == seq_before and sink_after == sink_before
            print(
                f"   re-run of {rerun}: stream last seq {seq_before} -> {seq_after}, sink "
                f"{sink_before[0]} flights #{sink_before[1]} -> {sink_after[0]} flights "
                f"#{sink_after[1]}: {'nothing changed' if unchanged else 'CHANGED'}"
            )

            table.append(day_row(meta, rerun, rerun=True))
            print(
                f"\n{'day':<18}{'published':>11}{'refused':>9}{'drained in s':>14}  verified"
                "  (drained: seconds from the publish task's end)"
            )
            for line, _ in table:
                print(line)
            all_verified = all(ok_day for _, ok_day in table)
            ok = all_verified and unchanged and bool(killed)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
        finally:
            codes = svc.stop()
            print(f"\n   stopped (exit codes {codes}); logs in {work / 'logs'}")
    took = time.monotonic() - t0
    print(f"\n== demo {'verified' if ok else 'FAILED'} in {took:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
