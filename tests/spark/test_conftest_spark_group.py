"""tests/conftest.py keeps the tests that use the ``spark`` fixture in one pytest-xdist worker
under ``make test``'s ``-n 2 --dist loadgroup`` (one Spark JVM per run, not one per worker).

A small suite of its own runs in a subprocess with conftest.py's hook: six tests using a
``spark`` fixture and twelve others, each long enough that both workers take part."""

from __future__ import annotations

import re
import subprocess
import sys

from locations import TESTS

CONFTEST = TESTS / "conftest.py"

TOY_CONFTEST = f"""
import importlib.util
import os

import pytest

spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems


@pytest.fixture(scope="session")
def spark():
    return os.environ["PYTEST_XDIST_WORKER"]
"""

TOY_TESTS = """
import time

import pytest


@pytest.mark.parametrize("i", range(6))
def test_uses_spark(spark, i):
    time.sleep(0.2)


@pytest.mark.parametrize("i", range(12))
def test_other(i):
    time.sleep(0.2)
"""


def test_tests_using_the_spark_fixture_run_in_one_worker_under_loadgroup(tmp_path):
    (tmp_path / "conftest.py").write_text(TOY_CONFTEST)
    (tmp_path / "test_toy.py").write_text(TOY_TESTS)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2"]
        + ["--dist", "loadgroup", "-v", "-o", "addopts=", "-o", "testpaths=.", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\].*PASSED .*::(test_\w+)\[(\d+)\]", r.stdout)
    assert len(ran) == 18, r.stdout[-3000:]
    spark_workers = {gw for gw, name, _ in ran if name == "test_uses_spark"}
    assert len(spark_workers) == 1, f"the spark tests ran in {sorted(spark_workers)}"
    # while the other worker runs the rest (the group is one unit of work)
    assert {gw for gw, name, _ in ran if name == "test_other"} == {"gw0", "gw1"}, r.stdout
