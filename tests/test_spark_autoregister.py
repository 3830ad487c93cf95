"""``format("nats-ordered")`` is found in any session and thread of an installed environment
(issue 17 item 7): the ``pyspark_nats_ordered`` package is what Spark 4 looks up at the
first Python data source call of an application (top-level ``pyspark_*`` modules with a
``DefaultSource``), so no ``register(spark)`` is needed. The shared session of the test run
did register; a new session in another thread has none of its registrations.

Issue 28 item 11: Spark reads the calling thread's active session to tell a Python data
source, so the same session used from a new thread failed for ``format()``, after
``register()`` and in ``write_ordered()``."""

from __future__ import annotations

import threading

from spark_helpers import make_stream, stored


def test_a_new_session_in_another_thread_finds_the_format_without_register(
    spark, nats_url, unique_name
):
    make_stream(nats_url, unique_name, partitions=2)
    failure: list[BaseException] = []

    def write() -> None:
        try:
            other = spark.newSession()  # no register(): none of the fixture's registrations
            df = other.createDataFrame([(f"k{i}", i) for i in range(20)], "k string, i int")
            (
                df.write.format("nats-ordered")
                .option("stream", unique_name)
                .option("keyColumn", "k")
                .option("producerId", "autoregistered")
                .option("url", nats_url)
                .mode("append")
                .save()
            )
        except BaseException as exc:  # reported below, with Spark's message
            failure.append(exc)

    t = threading.Thread(target=write)
    t.start()
    t.join(300)
    assert not t.is_alive(), "the write did not finish"
    assert not failure, f"{type(failure[0]).__name__}: {str(failure[0])[:1000]}"
    rows = stored(nats_url, unique_name)
    assert len(rows) == 20 and len({r.msg_id for r in rows}) == 20


# --- the same session from a new thread ------------------------------------------------------


def _in_new_thread(spark, fn) -> None:
    """Run ``fn`` in a new thread, whose JVM thread has no active session (checked first):
    what a scheduler's or a notebook runner's thread gets. Re-raises its failure."""
    failure: list[BaseException] = []

    def body() -> None:
        try:
            active = spark._jvm.org.apache.spark.sql.classic.SparkSession.getActiveSession()
            assert not active.isDefined(), "the new thread already has an active session"
            fn()
        except BaseException as exc:  # re-raised below, with Spark's message
            failure.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join(300)
    assert not t.is_alive(), "the write did not finish"
    if failure:
        raise AssertionError(f"{type(failure[0]).__name__}: {str(failure[0])[:1000]}")


def _rows(spark, n: int = 20):
    """A DataFrame made in this (the test's) thread, without createDataFrame (which would
    make the session active in the thread that calls it)."""
    from pyspark.sql import functions as F

    return spark.range(n).select(
        F.concat(F.lit("k"), F.col("id").cast("string")).alias("k"), F.col("id").alias("i")
    )


def _save(df, stream: str, url: str, producer_id: str) -> None:
    (
        df.write.format("nats-ordered")
        .option("stream", stream)
        .option("keyColumn", "k")
        .option("producerId", producer_id)
        .option("url", url)
        .mode("append")
        .save()
    )


def test_format_works_from_a_new_thread_of_the_same_session(spark, nats_url, unique_name):
    make_stream(nats_url, unique_name, partitions=2)
    df = _rows(spark)
    _in_new_thread(spark, lambda: _save(df, unique_name, nats_url, "from-thread"))
    assert len(stored(nats_url, unique_name)) == 20


def test_register_in_a_new_thread_makes_the_format_usable_there(spark, nats_url, unique_name):
    from airflow_nats_ordered.spark import register

    make_stream(nats_url, unique_name, partitions=2)
    df = _rows(spark)

    def register_then_save() -> None:
        register(spark)
        _save(df, unique_name, nats_url, "registered-in-thread")

    _in_new_thread(spark, register_then_save)
    assert len(stored(nats_url, unique_name)) == 20


def test_write_ordered_works_from_a_new_thread_of_the_same_session(spark, nats_url, unique_name):
    from airflow_nats_ordered.spark import write_ordered

    make_stream(nats_url, unique_name, partitions=2)
    df = _rows(spark)
    records = []
    _in_new_thread(
        spark,
        lambda: records.append(
            write_ordered(
                df,
                stream=unique_name,
                key="k",
                order_by="i",
                producer_id="ordered-in-thread",
                connection={"url": nats_url},
            )
        ),
    )
    assert records[0].status == "complete" and records[0].acked == 20
    assert len(stored(nats_url, unique_name)) == 20
