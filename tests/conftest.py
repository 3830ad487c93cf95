"""Pytest fixtures running real nats-server processes (see
``airflow_nats_ordered.embedded.servers``).

* ``nats_server`` - a fresh single JetStream server per test, store in ``tmp_path``; use it
  when the test kills/restarts the server or needs an empty server.
* ``shared_nats_server`` - one server for the whole session; fast, but tests must use
  unique stream/bucket/subject names (see ``unique_name``) and must not stop it.
* ``nats_url`` - URL of ``shared_nats_server``.
* ``nats_cluster`` - a fresh 3-node JetStream cluster per test (marker ``cluster``).
* ``unique_name`` - a fresh ``T_<hex>`` name, valid as a stream, bucket or subject token.

Tests are plain ``def`` functions that call ``asyncio.run(...)``; there is no
pytest-asyncio. Every process is stopped at fixture teardown (and killed at exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Test helpers (natsserver, authfixtures) are imported as top-level modules from tests/.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from js_client import node  # noqa: E402, F401  (the fixture, for tests of any folder)

from airflow_nats_ordered.embedded.servers import NatsCluster, NatsServer  # noqa: E402

# One throw-away Airflow home for the whole run (never the user's ~/airflow); Airflow reads
# it when first imported, so it is set before any test module imports airflow.
# Under pytest-xdist each worker process gets its own home (the controller's would be shared
# by both workers, which would migrate one SQLite database at once).
if (
    "AIRFLOW_HOME" not in os.environ
    or os.environ.get("CI")
    or os.environ.get("PYTEST_XDIST_WORKER")
):
    _airflow_home = tempfile.mkdtemp(prefix="nats-ordered-airflow-")
    atexit.register(shutil.rmtree, _airflow_home, True)
    os.environ["AIRFLOW_HOME"] = _airflow_home
    # One Fernet key for every Airflow process of the run. Without it each process that
    # finds no airflow.cfg in a fresh home generates a key of its own and races to write
    # the file: a triggerer started beside `dags reserialize` could not decrypt the
    # trigger kwargs the other wrote (JSONDecodeError, runner dead), as CI's fresh
    # clones showed for the three triggerers of test_airflow_watcher_kills.
    from cryptography.fernet import Fernet

    os.environ["AIRFLOW__CORE__FERNET_KEY"] = Fernet.generate_key().decode()
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

# Property tests check results, never speed: hypothesis' default 200 ms deadline per example
# is a wall-clock budget that a loaded 2-core machine misses (DeadlineExceeded on a correct
# assignment), so no deadline, and no health check that times data generation.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "nats-ordered", deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("nats-ordered")
except ImportError:  # hypothesis is a dev dependency; only the property tests need it
    pass


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh JetStream server on free loopback ports, stopped after the test."""
    with NatsServer(tmp_path / "nats", name="test-server") as server:
        yield server


@pytest.fixture(scope="session")
def shared_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One JetStream server shared by the session; use unique names, never stop it."""
    with NatsServer(tmp_path_factory.mktemp("shared-nats"), name="shared") as server:
        yield server


@pytest.fixture
def nats_url(shared_nats_server: NatsServer) -> str:
    """``nats://127.0.0.1:PORT`` of the shared server."""
    return shared_nats_server.url


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A fresh 3-node JetStream cluster (meta leader elected), stopped after the test."""
    with NatsCluster(tmp_path / "cluster", n=3) as cluster:
        yield cluster


@pytest.fixture
def unique_name() -> str:
    """A unique ``T_<hex>`` name usable as stream, KV bucket, consumer or subject token."""
    return f"T_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The one SparkSession of the test run (a process holds one SparkContext), with the
    ``nats-ordered`` source registered. ``local[2,2]``: two task threads, and a failed task
    is retried once, as a cluster would. Executors use this interpreter (PYSPARK_PYTHON)."""
    pytest.importorskip("pyspark")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from airflow_nats_ordered.spark import register

    work = tmp_path_factory.mktemp("spark")
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("nats-ordered-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.speculation", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        .config("spark.local.dir", str(work / "local"))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
    # py4j logs "Closing down clientserver connection" from __del__ at interpreter exit,
    # after pytest closed the streams ("--- Logging error ---"): nothing to report
    logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 3 --dist loadgroup``) every test that uses
    the SparkSession runs in one worker, so a run still starts one Spark JVM.

    ``--dist loadgroup`` sends tests whose node ids end in the same ``@<group>`` to one
    worker. pytest-xdist appends that suffix in its own ``pytest_collection_modifyitems``,
    which runs before this one (so it never saw a mark added here) and, since pytest 9.2
    keeps the node id in ``Node._id``, no longer renames anything: the Spark tests were
    spread over both workers, each starting a JVM. So the suffix is set here, after xdist's
    hook (``trylast``), in xdist workers running ``--dist loadgroup`` only."""
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set by xdist in workers
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("spark"))
            if loadgroup and not item.nodeid.endswith("@spark"):
                _set_nodeid(item, f"{item.nodeid}@spark")


def _set_nodeid(item: pytest.Item, nodeid: str) -> None:
    if hasattr(item, "_id"):  # pytest >= 9.2: a structured NodeId
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid
