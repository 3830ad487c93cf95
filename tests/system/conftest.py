"""What the example DAGs of ``tests/system/nats_ordered`` need, and nothing else: a NATS server.

* ``SYSTEM_TESTS_ENV_ID`` (as in Airflow's system tests) is set to a fresh id when not given,
  before the examples are imported: their stream names end with it, so each test session
  (and each pytest-xdist worker, which has its own server) uses its own streams.
* Every example test gets the Airflow connection ``nats_default`` pointing at the session's
  shared nats-server (``AIRFLOW_CONN_NATS_DEFAULT``, JSON form). An environment variable,
  not a row in the metadata database: ``dag.test()`` runs a deferred sensor's trigger in its
  own process, where Airflow reads no database connection (docs/airflow.md says so).
* An example that names a consumer group (a module constant ``GROUP``) assumes its workers run
  beside Airflow, as in a deployment: the stream ``STREAM`` is provisioned with
  ``PARTITIONS`` partitions and a pool of two workers (member ids ``worker-1``, ``worker-2``,
  a handler that accepts every message) consumes the group while the test runs.

The Airflow home is the test session's one (tests/conftest.py); the examples run with
``dag.test()`` through :func:`system.utils.get_test_run`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("SYSTEM_TESTS_ENV_ID", uuid.uuid4().hex[:8])


@pytest.fixture(autouse=True)
def nats_default(monkeypatch: pytest.MonkeyPatch, shared_nats_server: Any) -> str:
    """``nats_default`` -> the shared server, for the test."""
    from airflow_dags import nats_connection

    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(shared_nats_server.url))
    return "nats_default"


@pytest.fixture(autouse=True)
def group_workers(request: pytest.FixtureRequest, nats_default: str) -> Iterator[None]:
    """A worker pool on the example's ``GROUP`` of ``STREAM`` while its test runs."""
    module = request.module
    group = getattr(module, "GROUP", None)
    if group is None:
        yield
        return
    from airflow_dags import BackgroundPool, on_server

    from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
    from airflow_nats_ordered.core.worker.config import WorkerConfig

    url = request.getfixturevalue("shared_nats_server").url
    stream, partitions = module.STREAM, module.PARTITIONS

    async def create(nc: Any) -> None:
        await provision(nc, StreamSpec(stream, partitions=partitions))

    async def accept(msg: Any) -> None:
        pass

    on_server(url, create)
    config = WorkerConfig(stream, group, member_id="worker", lease_ttl=2.0, commit_interval=0.2)
    with BackgroundPool(url, config, accept, size=2):
        yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "system: an example DAG run as Airflow's provider system tests run theirs"
    )


def pytest_collect_file(file_path: Any, parent: pytest.Collector) -> pytest.Module | None:
    """Collect the ``example_*.py`` files here too (Airflow's pytest settings list them in
    ``python_files``; this keeps that to tests/system). A file named on the command line is
    collected by pytest itself."""
    if parent.session.isinitpath(file_path):
        return None
    if file_path.name.startswith("example_") and file_path.suffix == ".py":
        return pytest.Module.from_parent(parent, path=file_path)
    return None
