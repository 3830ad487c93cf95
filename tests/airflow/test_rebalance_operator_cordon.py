"""``NatsRebalanceOperator(cordon=...)`` takes the members from a task at run time (an
XComArg) or a template, so a DAG need not name member ids when it is written (issue 30,
defect 2: the example DAG named the test fixture's). What it cannot use fails the task at
once, before any connection, naming the fix."""

from __future__ import annotations

import pytest
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowFailException

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.operators.group import NatsRebalanceOperator


def test_cordon_from_a_tasks_output_makes_that_task_upstream():
    with DAG(dag_id="rebalance_cordon_xcom", schedule=None):

        @task
        def pick() -> list[str]:
            return ["vm-2"]

        picked = pick()
        op = NatsRebalanceOperator(task_id="cordon", stream="S", group="g", cordon=picked)
    assert op.upstream_task_ids == {"pick"}


def test_a_literal_string_is_refused_when_the_dag_is_parsed_a_template_is_not():
    with pytest.raises(ConfigError, match="not the string 'vm-2'"):
        NatsRebalanceOperator(task_id="a", stream="S", group="g", cordon="vm-2")
    op = NatsRebalanceOperator(task_id="b", stream="S", group="g", cordon="{{ params.m }}")
    assert op.cordon == "{{ params.m }}"


@pytest.mark.parametrize(
    ("rendered", "words"),
    [
        ("['vm-2']", "render_template_as_native_obj=True"),
        (["vm-2", 3], "member ids (strings)"),
        (["vm-2", ""], "member ids (strings)"),
    ],
)
def test_a_cordon_that_rendered_to_no_list_of_ids_fails_the_task_at_once(rendered, words):
    op = NatsRebalanceOperator(task_id="c", stream="S", group="g", nats_conn_id="nowhere")
    op.cordon = rendered  # what rendering the template gave
    with pytest.raises(AirflowFailException, match=words.replace("(", r"\(").replace(")", r"\)")):
        op.execute({})
