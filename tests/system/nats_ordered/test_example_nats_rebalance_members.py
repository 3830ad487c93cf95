"""The rebalance example works against any pool, not only the system tests' (issue 30,
defect 2): its ``check`` task used to assert the fixture's member ids (``worker-1``,
``worker-2``) and failed against a normal ``nats-ordered pool``. Here it runs
(``dag.test()``, real nats-server, real workers) against members ``vm-1``, ``vm-2``; and a
run told to cordon ``worker-2`` there fails its ``cordon`` task naming the live members,
where the operator used to succeed with no move."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from airflow_dags import BackgroundPool, on_server, task_states

from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from system.utils import _in_dags_folder, _parse

EXAMPLE = Path(__file__).parent / "example_nats_rebalance.py"


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example, imported with an environment id of its own (its own stream), as the
    dags folder's copy will be parsed with it."""
    env_id = uuid.uuid4().hex[:8]
    monkeypatch.setenv("SYSTEM_TESTS_ENV_ID", env_id)
    spec = importlib.util.spec_from_file_location(f"example_nats_rebalance_{env_id}", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vm_pool(url: str, example: ModuleType) -> BackgroundPool:
    async def create(nc: Any) -> None:
        await provision(nc, StreamSpec(example.STREAM, partitions=example.PARTITIONS))

    async def accept(msg: Any) -> None:
        pass

    on_server(url, create)
    config = WorkerConfig(
        example.STREAM, example.GROUP, member_id="vm", lease_ttl=2.0, commit_interval=0.2
    )
    return BackgroundPool(url, config, accept, size=2)


def _run(example: ModuleType, **kwargs: Any) -> Any:
    _parse(example.dag)
    with _in_dags_folder(example.dag):
        return example.dag.test(**kwargs)


def test_the_example_cordons_one_of_the_pools_own_members(shared_nats_server, example):
    with _vm_pool(shared_nats_server.url, example):
        run = _run(example)
        xcom = {ti.task_id: ti.xcom_pull(task_ids=ti.task_id) for ti in run.get_task_instances()}
    assert task_states(run) == {
        "member_to_cordon": "success",
        "cordon": "success",
        "by_load": "success",
        "check": "success",
    }, task_states(run)
    assert xcom["member_to_cordon"] == ["vm-2"]
    assert set(xcom["cordon"]["owners"].values()) == {"vm-1"}
    assert set(xcom["by_load"]["owners"].values()) == {"vm-1", "vm-2"}


def test_a_run_told_to_cordon_a_member_the_group_does_not_have_fails_naming_the_live_ones(
    shared_nats_server, example, capfd
):
    with _vm_pool(shared_nats_server.url, example):
        run = _run(example, run_conf={"member": "worker-2"})
    out = capfd.readouterr()
    states = task_states(run)
    assert states["cordon"] == "failed", states
    assert "by_load" not in states or states["by_load"] != "success", states
    logged = out.out + out.err
    assert "cordon names member(s) the group does not know: worker-2" in logged
    assert "live members are vm-1, vm-2" in logged
