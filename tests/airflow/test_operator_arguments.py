"""Misspelt operator and sensor arguments fail naming the one meant. Airflow's own refusal
(``TypeError: Invalid arguments were passed to NatsPublishOperator ... {'key_feild': 'k'}``)
names the argument but not what was meant; every argument Airflow's base classes take
(BaseOperator's, a sensor's, SparkSubmitOperator's, ``default_args``) still passes."""

from __future__ import annotations

import datetime as dt

import pytest
from airflow.sdk import DAG

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.operators.group import NatsRebalanceOperator, NatsResetGroupOperator
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator
from airflow_nats_ordered.operators.streams import (
    NatsProvisionStreamOperator,
    NatsRepartitionStreamOperator,
)
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

MISSPELT = [
    (NatsPublishOperator, {"stream": "S", "key_feild": "k"}, "key_feild", "key_field"),
    (
        NatsProvisionStreamOperator,
        {"stream": "S", "partitions": 4, "subject_prefx": "x"},
        "subject_prefx",
        "subject_prefix",
    ),
    (
        NatsRepartitionStreamOperator,
        {"stream": "S", "partitions": 8, "nats_con_id": "n"},
        "nats_con_id",
        "nats_conn_id",
    ),
    (NatsRebalanceOperator, {"stream": "S", "group": "g", "cordons": ["m1"]}, "cordons", "cordon"),
    (
        NatsResetGroupOperator,
        {"stream": "S", "group": "g", "to": "earliest", "partition": 1},
        "partition",
        "partitions",
    ),
    (
        NatsGroupDrainSensor,
        {"stream": "S", "group": "g", "no_member_timeout": 5},
        "no_member_timeout",
        "no_members_timeout",
    ),
    (
        NatsGroupDrainSensor,
        {"stream": "S", "group": "g", "poke_intervall": 5},
        "poke_intervall",
        "poke_interval",
    ),
    (
        NatsSparkPublishOperator,
        {
            "application": "app.py",
            "stream": "S",
            "producer_id": "p",
            "executor_cores": 1,
            "num_executor": 2,
        },
        "num_executor",
        "num_executors",
    ),
]


@pytest.mark.parametrize(("op", "kwargs", "wrong", "meant"), MISSPELT)
def test_a_misspelt_argument_names_the_one_meant(op, kwargs, wrong, meant) -> None:
    with pytest.raises(ConfigError) as err:
        op(task_id="t", **kwargs)
    text = str(err.value)
    assert text.startswith(f"{op.__name__}: unknown argument(s) {wrong}= (did you mean "), text
    assert f"(did you mean {meant}=?)" in text, text


def test_the_base_classes_arguments_still_pass() -> None:
    with DAG(
        "args",
        schedule=None,
        start_date=dt.datetime(2024, 1, 1),
        default_args={"retries": 2, "owner": "data"},
    ):
        pub = NatsPublishOperator(
            task_id="pub", stream="S", key_field="k", records=[], retry_delay=5, pool="default_pool"
        )
        sensor = NatsGroupDrainSensor(
            task_id="drain", stream="S", group="g", mode="reschedule", soft_fail=True, timeout=60
        )
    assert (pub.retries, pub.owner, sensor.mode, sensor.retries) == (2, "data", "reschedule", 2)
