"""The drain sensor honours ``[operators] default_deferrable`` (issue 16 item 5) as every
Airflow provider's deferrable operator does: when the DAG does not pass ``deferrable``, the
deployment's setting decides, from the environment or airflow.cfg; an argument still wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

ENV = "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"
DEFAULT_DEFERRABLE_ENV = (ENV, f"{ENV}_CMD", f"{ENV}_SECRET")


def _sensor(**kwargs) -> NatsGroupDrainSensor:
    return NatsGroupDrainSensor(task_id="drained", stream="S", group="g", **kwargs)


@pytest.fixture
def unset(monkeypatch):
    for name in DEFAULT_DEFERRABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("value", "deferrable"), [("false", False), ("True", True)])
def test_the_deployment_setting_decides_when_the_dag_does_not(unset, value, deferrable):
    unset.setenv(ENV, value)
    assert _sensor().deferrable is deferrable


def test_an_argument_wins_over_the_deployment_setting(unset):
    unset.setenv(ENV, "false")
    assert _sensor(deferrable=True).deferrable is True
    unset.setenv(ENV, "true")
    assert _sensor(deferrable=False).deferrable is False


CHECK = (
    "from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor;"
    "print(NatsGroupDrainSensor(task_id='d', stream='S', group='g').deferrable)"
)


@pytest.mark.parametrize(("value", "expected"), [("false", "False"), ("true", "True")])
def test_airflow_cfg_decides_too(tmp_path, value, expected):
    """A deployment that sets the option in airflow.cfg, not the environment, is honoured
    both ways (the sensor used to stay deferrable on a false read from airflow.cfg)."""
    (tmp_path / "airflow.cfg").write_text(f"[operators]\ndefault_deferrable = {value}\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DEFAULT_DEFERRABLE_ENV and k != "AIRFLOW_CONFIG"
    }
    env["AIRFLOW_HOME"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
