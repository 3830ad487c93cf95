"""Misspelt trigger arguments fail, naming the argument and the one meant (issue 16 item
3). NatsMessageTrigger's (``subjects=``) are covered in test_airflow_watchers.py; the
drain trigger gave a bare TypeError."""

from __future__ import annotations

import pytest

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.triggers.drain import NatsGroupDrainTrigger
from airflow_nats_ordered.triggers.messages import NatsMessageTrigger


def _refused(build, wrong: str, meant: str) -> str:
    with pytest.raises(ConfigError) as err:
        build()
    text = str(err.value)
    assert f"{wrong}= (did you mean {meant}=?)" in text, text
    return text


def test_drain_trigger_refuses_a_misspelt_argument() -> None:
    text = _refused(
        lambda: NatsGroupDrainTrigger(
            stream="ORDERS", group="billing", marks={"0": 3}, no_member_timeout=5
        ),
        "no_member_timeout",
        "no_members_timeout",
    )
    assert text.startswith("NatsGroupDrainTrigger:") and "nats_conn_id" in text


@pytest.mark.parametrize(
    "trigger",
    [
        lambda: NatsMessageTrigger(stream="ORDERS", subject="orders.>", ack_wait=3),
        lambda: NatsGroupDrainTrigger(
            stream="ORDERS", group="billing", marks={"0": 3}, timeout=10, started=1.0
        ),
    ],
)
def test_what_a_trigger_serializes_builds_it_again(trigger) -> None:
    """The triggerer rebuilds a trigger from its serialized kwargs: all of them are known."""
    t = trigger()
    classpath, kwargs = t.serialize()
    assert type(t)(**kwargs).serialize() == (classpath, kwargs)
