"""A Spark run resumed with the same producerId: exact on the same input, refused on changed
input (issue 17 item 1), and from what the stream holds after an abort (item 2)."""

from __future__ import annotations

import json

import pytest
from spark_helpers import (
    WINDOW,
    exactly_once_in_order,
    on_server,
    run_record,
    stored,
    wait_past_the_window,
)

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import write_ordered  # noqa: E402

SCHEMA = "k string, ts long, i long, pad string"


def _rows(n: int = 60, keys: int = 6) -> list[dict]:
    return [{"k": f"key-{i % keys}", "ts": 1_000 + i, "i": i, "pad": ""} for i in range(n)]


def _write(spark, url: str, stream: str, rows: list[dict], producer: str, **kw):
    df = spark.createDataFrame(rows, SCHEMA).repartition(2)
    return write_ordered(
        df,
        stream=stream,
        key="k",
        order_by="ts",
        producer_id=producer,
        connection={"url": url},
        **kw,
    )


def _problems(rows: list[dict], url: str, stream: str) -> list[str]:
    return exactly_once_in_order(rows, stored(url, stream), "k", "ts")


@pytest.mark.parametrize("fault", ["too large", "no key"])
def test_a_refused_row_corrected_and_re_run_with_the_same_producer_id_is_refused(
    spark, nats_url, unique_name, fault
):
    spec = StreamSpec(unique_name, partitions=2, max_msg_size=64 * 1024)
    on_server(nats_url, lambda nc: provision(nc, spec))
    rows = _rows()
    bad = dict(rows[20])
    if fault == "too large":
        bad["pad"] = "x" * 70_000
    else:
        bad["k"] = None
    first = [bad if r["i"] == 20 else r for r in rows]
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, nats_url, unique_name, first, "fixme")
    rec = run_record(nats_url, unique_name, "fixme")
    assert rec is not None and rec.status == "partial" and rec.refused == 1
    good = [r for r in rows if r["i"] != 20]
    assert _problems(good, nats_url, unique_name) == []

    # the user "fixes the input" and runs the same producerId again: the resume would pass
    # over the first n positions of the corrected partition, which now hold other rows
    # (the old code: the corrected row missing, a later row of its partition stored twice)
    try:
        _write(spark, nats_url, unique_name, rows, "fixme")
        err = None
    except Exception as exc:
        err = exc
    assert _problems(good, nats_url, unique_name) == [], "rows sent after a changed prefix"
    assert err is not None, "the changed input was resumed"
    assert "input changed" in str(err) and "new producerId" in str(err), str(err)[-1500:]
    assert "new producerId" in (rec.error or ""), rec.error  # the first refusal says so too

    # the same input again resumes exactly; allowRefused publishes the rest and succeeds
    again = _write(spark, nats_url, unique_name, first, "fixme", allow_refused=True)
    assert again.status == "complete" and again.refused == 1
    # and the corrected input under a new producer id is a new run
    fixed = _write(spark, nats_url, unique_name, rows, "fixed")
    assert fixed.status == "complete" and fixed.acked == len(rows)


def test_resuming_a_partial_run_on_the_same_input_stores_every_row_once(
    spark, nats_url, unique_name
):
    spec = StreamSpec(unique_name, partitions=3)
    on_server(nats_url, lambda nc: provision(nc, spec))
    rows = _rows(90)
    first = [dict(r, k=None) if r["i"] % 10 == 3 else r for r in rows]
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, nats_url, unique_name, first, "same")
    rec = run_record(nats_url, unique_name, "same")
    assert rec is not None and sorted(rec.prefix_digests) == sorted(rec.acked_per_partition)
    ok = _write(spark, nats_url, unique_name, first, "same", allow_refused=True)
    assert ok.status == "complete" and ok.skipped == len(rows) - 9 and ok.acked == len(rows) - 9
    want = [r for r in first if r["k"] is not None]
    assert _problems(want, nats_url, unique_name) == []
    assert json.loads(stored(nats_url, unique_name)[0].data)["k"] is not None


def _fail_task_0_while_task_1_is_cancelled(url: str, stream: str, producer: str):
    """A pass-through ``mapInArrow`` step: once the stream holds rows, every attempt of Spark
    partition 0 fails (the job is aborted) while Spark partition 1 waits in the middle of its
    input until the abort is recorded (Spark cancels it meanwhile), for 3 s at most."""

    def step(batches):
        import asyncio
        import time

        import nats
        from pyspark import TaskContext

        from airflow_nats_ordered.core.publish.runs import RunLedger

        async def count() -> int:
            nc = await nats.connect(url)
            try:
                return (await nc.jetstream().stream_info(stream)).state.messages
            finally:
                await nc.close()

        async def status() -> str:
            nc = await nats.connect(url)
            try:
                rec = await (await RunLedger.open(nc, stream)).get(producer)
                return rec.status if rec is not None else ""
            finally:
                await nc.close()

        task = TaskContext.get().partitionId()
        for n, b in enumerate(batches):
            yield b
            if n == 3:
                deadline = time.monotonic() + 30
                while asyncio.run(count()) == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                if task == 0:
                    raise RuntimeError("injected: Spark partition 0 fails for good")
                deadline = time.monotonic() + 3  # (Spark may wait for it to end)
                while time.monotonic() < deadline:
                    if asyncio.run(status()) not in ("running", ""):
                        break
                    time.sleep(0.1)
                raise RuntimeError("injected: Spark partition 1 cancelled by the abort")

    return step


# Found at the issue 28 review: a failed task attempt's writer stored rows after its retry
# read the stream, and the retry, coming past the duplicate window, stored them again (4 of
# 7 runs at load 14-22). Each attempt's first row per partition now expects the tail it read
# (the core publisher's fence, tests/spark/test_spark_late_attempt.py); this test, an xfail
# until then, passed 8 of 8 runs after it (5 quiet, 3 beside six CPU hogs). Over 100 s (the
# abort, then the duplicate window): make test-slow, which CI runs too, keeps make test
# inside its 10 minutes (571 s with it in a fresh clone).
@pytest.mark.slow
def test_an_aborted_job_records_what_is_stored_and_a_resubmit_past_the_window_resumes_it(
    spark, nats_url, unique_name
):
    """Issue 17 item 2: one task fails for good while another is cancelled by the abort; the
    ledger had nothing of the run, and a re-submit after the duplicate window stored every
    row again. Now the abort records what the stream holds and the re-submit resumes."""
    from airflow_nats_ordered.spark import route

    spec = StreamSpec(unique_name, partitions=4, duplicate_window=WINDOW)
    on_server(nats_url, lambda nc: provision(nc, spec))
    rows = [{**r, "pad": "x" * 200} for r in _rows(2000, 40)]
    df = spark.createDataFrame(rows, SCHEMA)
    routed = route(df, key="k", partitions=4, order_by=["ts"], tasks=2)
    assert min(routed.rdd.glom().map(len).collect()) > 400  # both tasks hold rows

    def write(frame) -> None:
        (
            frame.write.format("nats-ordered")
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("orderBy", "ts")
            .option("producerId", "aborted")
            .option("deliveryTimeout", "1")
            .option("url", nats_url)
            .mode("append")
            .save()
        )

    failing = routed.mapInArrow(
        _fail_task_0_while_task_1_is_cancelled(nats_url, unique_name, "aborted"), routed.schema
    )
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        with pytest.raises(Exception, match="injected: Spark partition"):
            write(failing)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    at_abort = stored(nats_url, unique_name)
    assert 0 < len(at_abort) < len(rows)
    rec = run_record(nats_url, unique_name, "aborted")
    assert rec is not None and rec.status == "partial"
    per_partition: dict[int, int] = {}
    for s in at_abort:
        p = int(s.subject.rsplit(".", 1)[1])
        per_partition[p] = per_partition.get(p, 0) + 1

    wait_past_the_window(nats_url, unique_name)
    write(routed)
    problems = _problems(rows, nats_url, unique_name)
    assert problems == [], f"{len(at_abort)} rows were stored at the abort: {problems}"
    done = run_record(nats_url, unique_name, "aborted")
    assert done is not None and done.status == "complete" and done.acked == len(rows)
    # what the abort recorded was what the stream held of the run (the cancelled task may
    # have stored a little more after it read the stream)
    assert rec.acked_per_partition, rec.to_dict()
    assert all(rec.acked_per_partition.get(p, 0) <= n for p, n in per_partition.items())
    assert "re-submitting the job with the same input resumes" in (rec.error or ""), rec.error


def _retry_after_the_window(url: str, stream: str):
    """A pass-through ``mapInArrow`` step: attempt 0 of each task fails once the stream holds
    rows; attempt 1 starts handing on its rows only after the duplicate window has passed
    since the newest stored message (a retry that comes late, as on a busy cluster)."""

    def step(batches):
        import asyncio
        import datetime as dt
        import time

        import nats
        from pyspark import TaskContext

        async def newest() -> tuple[int, dt.datetime | None]:
            nc = await nats.connect(url)
            try:
                js = nc.jetstream()
                state = (await js.stream_info(stream)).state
                if not state.messages:
                    return 0, None
                return state.messages, (await js.get_msg(stream, state.last_seq)).time
            finally:
                await nc.close()

        attempt = TaskContext.get().attemptNumber()
        if attempt > 0:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                _, last = asyncio.run(newest())
                limit = last + dt.timedelta(seconds=WINDOW + 1) if last else None
                if limit is None or dt.datetime.now(dt.UTC) > limit:
                    break
                time.sleep(0.2)
        for n, b in enumerate(batches):
            yield b
            if n == 3 and attempt == 0:
                deadline = time.monotonic() + 30
                while asyncio.run(newest())[0] == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError("injected: fails once rows are stored")

    return step


def test_a_task_retried_after_the_window_resumes_from_what_its_failed_attempt_stored(
    spark, nats_url, unique_name
):
    """A new run's task fails after storing rows and its retry comes after the duplicate
    window: the retry passes over what the failed attempt stored (read from the stream),
    instead of sending it again."""
    from airflow_nats_ordered.spark import route

    spec = StreamSpec(unique_name, partitions=2, duplicate_window=WINDOW)
    on_server(nats_url, lambda nc: provision(nc, spec))
    rows = [{**r, "pad": "x" * 200} for r in _rows(1000, 20)]
    routed = route(
        spark.createDataFrame(rows, SCHEMA), key="k", partitions=2, order_by=["ts"], tasks=1
    )
    late = routed.mapInArrow(_retry_after_the_window(nats_url, unique_name), routed.schema)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        (
            late.write.format("nats-ordered")
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("orderBy", "ts")
            .option("producerId", "late-retry")
            .option("deliveryTimeout", "1")
            .option("url", nats_url)
            .mode("append")
            .save()
        )
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert _problems(rows, nats_url, unique_name) == []
    rec = run_record(nats_url, unique_name, "late-retry")
    assert rec is not None and rec.status == "complete" and rec.skipped > 0, rec.to_dict()
