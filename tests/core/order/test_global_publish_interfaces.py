"""A global sequence from the other publishing interfaces (issue 18 part 1): `nats-ordered
publish --global-order` and `NatsPublishOperator(global_order=True)` in a real DAG run; the
stored records, read back by ``Nats-Global-Seq``, come out in publish order."""

from __future__ import annotations

import contextlib
import json

from airflow_dags import dag_file, nats_connection, on_server, task_states
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.order.watermarks import HDR_GLOBAL_SEQ
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


def _by_global_seq(url: str, stream: str) -> tuple[list[int], list[int], dict[int, int]]:
    """The records' ``i`` in global-sequence order, their sequences, and the watermarks."""

    async def read(nc):
        js = nc.jetstream()
        last = (await js.stream_info(stream)).state.last_seq
        rows = []
        for seq in range(1, last + 1):
            m = await js.get_msg(stream, seq)
            rows.append((int((m.headers or {})[HDR_GLOBAL_SEQ]), json.loads(m.data)["i"]))
        kv = await js.key_value(watermark_bucket(stream))
        marks = {}
        for key in await kv.keys():
            marks[int(key[2:])] = json.loads((await kv.get(key)).value)["g"]
        return rows, marks

    rows, marks = on_server(url, read)
    rows.sort()
    return [i for _, i in rows], [g for g, _ in rows], marks


def test_cli_publish_global_order_stamps_publish_order(nats_url, unique_name, tmp_path, capsys):
    def provisioned(nc):
        return provision(nc, StreamSpec(unique_name, partitions=4))

    on_server(nats_url, provisioned)
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 9}", "i": i} for i in range(40)))
    more = write_jsonl(tmp_path / "more.jsonl", ({"k": f"k{i % 5}", "i": i} for i in range(40, 55)))
    for path in (rows, more):  # the second run continues the first one's order
        args = ["publish", "--stream", unique_name, str(path), "--key-field", "k"]
        assert cli([*args, "--global-order", "--server", nats_url]) == 0, capsys.readouterr()
    order, seqs, marks = _by_global_seq(nats_url, unique_name)
    assert order == list(range(55))  # every record once, in the order it was published
    assert len(set(seqs)) == 55
    assert set(marks) == {0, 1, 2, 3}  # each partition's watermark, for idle partitions
    assert "--global-order" in _help(capsys)


def _help(capsys) -> str:
    capsys.readouterr()
    with contextlib.suppress(SystemExit):
        cli(["publish", "--help"])
    return capsys.readouterr().out


PUBLISH = """
import datetime as dt
from airflow.sdk import DAG
from airflow_nats_ordered.operators.publish import NatsPublishOperator

def records(n):
    return [{{"k": f"key{{i % 11}}", "i": i}} for i in range(n)]

with DAG(dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1)) as dag:
    NatsPublishOperator(
        task_id="publish", stream="{stream}", key_field="k", global_order=True,
        records_callable=records, op_kwargs={{"n": 60}},
    )
    NatsPublishOperator(
        task_id="mixed_up", stream="{stream}", key_field="k",
        publisher_config={{"global_order": True}}, records=[{{"k": "a", "i": 0}}],
    )
"""


def test_publish_operator_global_order_in_a_dag_run(nats_url, unique_name, monkeypatch, capfd):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    def provisioned(nc):
        return provision(nc, StreamSpec(unique_name, partitions=4))

    on_server(nats_url, provisioned)
    with dag_file(PUBLISH, stream=unique_name) as dag:
        run = dag.test()
    states = task_states(run)
    out = capfd.readouterr()
    assert states["publish"] == "success", states
    # global_order is the operator's own argument: in publisher_config it is refused, by name
    assert states["mixed_up"] == "failed", states
    assert "global_order are arguments of the operator itself" in out.out + out.err
    order, _, marks = _by_global_seq(nats_url, unique_name)
    assert order == list(range(60))
    assert set(marks) == {0, 1, 2, 3}
