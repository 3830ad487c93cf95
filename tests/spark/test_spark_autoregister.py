"""``format("nats-ordered")`` is found in any session and thread of an installed environment
(issue 17 item 7): the ``pyspark_nats_ordered`` package is what Spark 4 looks up at the
first Python data source call of an application (top-level ``pyspark_*`` modules with a
``DefaultSource``), so no ``register(spark)`` is needed. The shared session of the test run
did register; a new session in another thread has none of its registrations.

Issue 28 item 11: that lookup is ``pkgutil.iter_modules()``, which the editable install
satisfied only with the working directory at the project root (a driver started elsewhere
got ``DATA_SOURCE_NOT_FOUND``), and Spark reads the calling thread's active session to tell
a Python data source, so the same session used from a new thread failed for ``format()``,
after ``register()`` and in ``write_ordered()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from locations import ROOT, TESTS
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


# --- any working directory, editable or wheel (issue 28 item 11) ---------------------------

_LIST_PYSPARK_MODULES = (
    "import json, pkgutil;"
    "print(json.dumps({m.name: getattr(m.module_finder, 'path', '') for m in "
    "pkgutil.iter_modules() if m.name.startswith('pyspark_')}))"
)


def test_the_installed_package_is_where_sparks_lookup_sees_it_from_any_directory(tmp_path):
    """Spark's lookup is ``pkgutil.iter_modules()``, which lists ``sys.path`` entries only:
    the editable install of ``make venv`` must put ``pyspark_nats_ordered`` on one, not behind
    an import hook that only ``import`` consults."""
    r = subprocess.run(
        [sys.executable, "-c", _LIST_PYSPARK_MODULES],
        cwd=tmp_path,
        env=_env_without_pythonpath(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert "pyspark_nats_ordered" in found, (
        f"pkgutil.iter_modules() from {tmp_path} lists {found or 'no pyspark_* module'}"
    )


def test_the_wheel_puts_pyspark_nats_ordered_where_sparks_lookup_sees_it(tmp_path):
    """A wheel built from the project holds ``pyspark_nats_ordered`` at the top of
    site-packages, listed by ``pkgutil.iter_modules()`` and defining ``DefaultSource`` named
    ``nats-ordered`` from the wheel's own ``airflow_nats_ordered``. (The wheel's files are
    unpacked as an installer would into site-packages; the full install into a fresh venv
    with a Spark write is too slow for the suite.)"""
    dist, site = tmp_path / "dist", tmp_path / "site"
    uv = Path(sys.executable).parent / "uv"
    build = (
        [str(uv), "build", "--out-dir", str(dist), str(ROOT)]
        if uv.exists()
        else [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(ROOT)]
    )
    r = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = dist.glob("airflow_nats_ordered-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        _LIST_PYSPARK_MODULES + ";"
        "import pyspark_nats_ordered as p, inspect;"
        "print(json.dumps([p.DefaultSource.name(), inspect.getfile(p.DefaultSource)]))"
    )
    env = _env_without_pythonpath()
    env["PYTHONPATH"] = str(site)  # before the venv's site-packages and its editable install
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    listed, (name, source_file) = (json.loads(line) for line in r.stdout.splitlines())
    assert listed.get("pyspark_nats_ordered") == str(site), listed
    assert name == "nats-ordered"
    assert Path(source_file).is_relative_to(site), source_file


@pytest.mark.slow  # its own spark-submit JVMs for 1.5 min: make test-slow, one at a time
def test_format_is_found_without_register_with_the_working_directory_elsewhere(
    nats_url, unique_name, tmp_path
):
    """A driver started outside the project writes with ``format("nats-ordered")`` before
    anything of this project is imported, then from a new thread once it is: both stored."""
    make_stream(nats_url, unique_name, partitions=2)
    r = subprocess.run(
        [
            sys.executable,
            str(TESTS / "spark_discovery_app.py"),
            nats_url,
            unique_name,
        ],
        cwd=tmp_path,
        env={**_env_without_pythonpath(), "PYSPARK_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {
        res["case"]: res
        for res in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))
    }
    assert set(results) == {"main-thread", "new-thread"}, r.stdout[-2000:] + r.stderr[-3000:]
    failed = [f"{case}: {res['error']}" for case, res in results.items() if not res["ok"]]
    assert not failed, "\n".join(failed)
    rows = stored(nats_url, unique_name)
    assert len(rows) == 20 and len({r.msg_id for r in rows}) == 20


def _env_without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


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
