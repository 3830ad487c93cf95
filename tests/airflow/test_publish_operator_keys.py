"""The publish operator words a bad key value of a file in its own terms (``key_field``), not
the CLI's flag: a user of the operator has no ``--key-field`` to fix."""

from __future__ import annotations

import pytest

from airflow_nats_ordered.inputs.records import InputError
from airflow_nats_ordered.operators.publish import NatsPublishOperator


def test_a_float_key_in_a_file_is_refused_naming_key_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"k": "a", "v": 1}\n{"k": 1.0, "v": 2}\n')
    op = NatsPublishOperator(task_id="publish", stream="S", path=str(path), key_field="k")
    with pytest.raises(InputError) as err:
        list(op._records())
    msg = str(err.value)
    assert "key_field" in msg and "--key-field" not in msg, msg
