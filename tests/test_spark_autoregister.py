"""``format("nats-ordered")`` is found in any session and thread of an installed environment
(issue 17 item 7): the ``pyspark_nats_ordered`` package is what Spark 4 looks up at the
first Python data source call of an application (top-level ``pyspark_*`` modules with a
``DefaultSource``), so no ``register(spark)`` is needed. The shared session of the test run
did register; a new session in another thread has none of its registrations."""

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
