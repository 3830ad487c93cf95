"""The publish operators' lineage (issue 16 item 6): the stream as an outlet asset
(``stream_outlet=True``), checked by a real DAG run (``dag.test()``, the session's metadata
DB, a real nats-server) that must leave an AssetEvent for ``nats://<STREAM>``; and the
OpenLineage facets, read through the OpenLineage provider's own extractor from real
operators with real connections holding secrets that must not appear in them."""

from __future__ import annotations

import json

import pytest
from airflow_dags import dag_file, nats_connection, on_server, task_states

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.operators.publish import NatsPublishOperator
from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator

OUTLETS = """
import datetime as dt
from airflow.sdk import DAG, AssetAlias
from airflow_nats_ordered.operators.publish import NatsPublishOperator

with DAG(
    dag_id="{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1),
    params={{"stream": "{stream}"}},
) as dag:
    NatsPublishOperator(
        task_id="declared", stream="{stream}", key_field="k",
        records=[{{"k": "a"}}, {{"k": "b"}}], stream_outlet=True,
    )
    NatsPublishOperator(
        task_id="templated", stream="{{{{ params.stream }}}}", key_field="k",
        records=[{{"k": "c"}}], stream_outlet=True, outlets=[AssetAlias("{dag_id}_out")],
    )
    NatsPublishOperator.partial(
        task_id="mapped", key_field="k", records=[{{"k": "e"}}], stream_outlet=True,
        outlets=[AssetAlias("{dag_id}_mapped")],
    ).expand(stream=["{stream}"])
    NatsPublishOperator.partial(
        task_id="mapped_no_alias", key_field="k", records=[{{"k": "f"}}], stream_outlet=True,
    ).expand(stream=["{stream}"])
"""


def _asset_events(uri: str) -> list[tuple[str, dict]]:
    """``(source task id, extra)`` of every AssetEvent of the asset ``uri``."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetEvent.source_task_id, AssetEvent.extra)
            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.uri == uri)
        ).all()
        return [(task_id, dict(extra or {})) for task_id, extra in rows]


def test_stream_outlet_makes_each_successful_publish_an_asset_event(
    nats_url, unique_name, monkeypatch, capfd
):
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(nats_url))

    async def make(nc) -> None:
        await provision(nc, StreamSpec(unique_name, partitions=2))

    on_server(nats_url, make)
    with dag_file(OUTLETS, stream=unique_name) as dag:
        tasks = {t.task_id: t for t in dag.tasks}
        # a literal stream is a declared outlet at parse time; a templated one is not
        assert [a.uri for a in tasks["declared"].outlets] == [f"nats://{unique_name}/"]
        assert [a.name for a in tasks["declared"].outlets] == [f"nats://{unique_name}"]
        run = dag.test()
    log = "".join(capfd.readouterr())
    states = task_states(run)
    # a mapped task's outlets are read from .partial(), before any stream is known: without
    # an alias to attach the stream to, the task fails saying so (instead of emitting an
    # asset no DAG declared, which the task runner refuses as inactive; dag.test() warns)
    assert states.pop("mapped_no_alias") == "failed"
    assert "the task is mapped, so the stream is not known" in log
    assert set(states.values()) == {"success"}, states
    events = _asset_events(f"nats://{unique_name}/")
    assert sorted(task_id for task_id, _ in events) == ["declared", "mapped", "templated"], events
    extras = dict(events)
    assert extras["declared"]["producer_id"].startswith(f"{dag.dag_id}.declared.")
    assert extras["declared"]["acked"] == 2
    assert extras["declared"]["status"] == "complete"
    assert set(extras["declared"]["high_water_marks"]) <= {"0", "1"}  # {"partition": seq}
    assert extras["declared"]["high_water_marks"]
    assert extras["templated"]["acked"] == 1
    assert extras["templated"]["producer_id"].startswith(f"{dag.dag_id}.templated.")
    assert extras["mapped"]["producer_id"].startswith(f"{dag.dag_id}.mapped.0.")


def test_the_outlet_is_opt_in_and_a_templated_stream_needs_an_alias():
    # without stream_outlet nothing is declared: what other DAGs schedule is unchanged
    plain = NatsPublishOperator(task_id="p", stream="ORDERS", key_field="k", records=[])
    assert plain.outlets == []
    with pytest.raises(ConfigError, match=r"outlets=\[AssetAlias\('<name>'\)\]") as info:
        NatsPublishOperator(
            task_id="p", stream="{{ params.stream }}", key_field="k", records=[], stream_outlet=True
        )
    assert "'{{ params.stream }}' is templated" in str(info.value)
    with pytest.raises(ConfigError, match="stream 'ORDERS.eu' cannot be an outlet asset"):
        NatsPublishOperator(
            task_id="p", stream="ORDERS.eu", key_field="k", records=[], stream_outlet=True
        )


SECRETS = {"password": "pw-Xq81-secret", "token": "tok-Zr57-secret"}


@pytest.mark.parametrize(
    "conn",
    [
        {"conn_type": "nats", "host": "Nats-1.Example", "port": 4333, "login": "alice",
         "password": SECRETS["password"]},
        {"conn_type": "nats", "extra": {"servers": "tls://nats-1.example:4333,nats://b:4222",
                                        "token": SECRETS["token"]}},
    ],
    ids=["login-password", "token-servers"],
)  # fmt: skip
def test_openlineage_output_is_the_stream_on_the_first_server_without_secrets(
    conn, unique_name, monkeypatch
):
    from airflow.providers.openlineage.extractors.base import DefaultExtractor
    from openlineage.client.serde import Serde

    monkeypatch.setenv("AIRFLOW_CONN_NATS_LINEAGE", json.dumps(conn))
    operators = [  # built one after the other: the publish operator's check comes first
        lambda: NatsPublishOperator(
            task_id="publish", stream=unique_name, key_field="k", records=[],
            nats_conn_id="nats_lineage",
        ),
        lambda: NatsSparkPublishOperator(
            task_id="spark_publish", application="app.py", stream=unique_name,
            nats_conn_id="nats_lineage",
        ),
    ]  # fmt: skip
    for make in operators:
        op = make()
        start = op.get_openlineage_facets_on_start()
        complete = op.get_openlineage_facets_on_complete(None)
        # the provider's extractor, which the OpenLineage listener uses for these operators
        extracted = DefaultExtractor(op).extract_on_complete(None)
        for lineage in (start, complete, extracted):
            assert lineage is not None and lineage.inputs == []
            (dataset,) = lineage.outputs
            assert (dataset.namespace, dataset.name) == ("nats://nats-1.example:4333", unique_name)
            shown = repr(lineage) + "".join(Serde.to_json(d) for d in lineage.outputs)
            for secret in (*SECRETS.values(), "alice"):
                assert secret not in shown, (op.task_id, shown)


def test_a_nats_asset_is_the_publish_operators_openlineage_dataset(unique_name, monkeypatch):
    """The provider's ``to_openlineage_converter`` (issue 30 defect 5), reached as the
    OpenLineage provider reaches it (its providers-manager registry, its extractor's manual
    inlets/outlets and hook-lineage paths): ``nats://<STREAM>[/<path>]`` is the stream's
    dataset in the namespace the publish operators report for the same connection. Before,
    no converter was registered and such assets were left out of lineage."""
    from airflow.providers.common.compat.openlineage.utils.utils import translate_airflow_asset
    from airflow.providers.openlineage.extractors import OperatorLineage
    from airflow.providers.openlineage.extractors.manager import ExtractorManager
    from airflow.sdk import Asset
    from airflow.sdk.bases.operator import BaseOperator
    from openlineage.client.serde import Serde

    from airflow_nats_ordered.hooks.nats import NatsHook

    default = {"conn_type": "nats", "host": "Nats-1.Example", "port": 4333, "login": "alice",
               "password": SECRETS["password"]}  # fmt: skip
    other = {"conn_type": "nats", "extra": {"servers": "tls://nats-9.example,nats://b:4222",
                                            "token": SECRETS["token"]}}  # fmt: skip
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", json.dumps(default))
    monkeypatch.setenv("AIRFLOW_CONN_NATS_LINEAGE", json.dumps(other))
    publish = NatsPublishOperator(task_id="publish", stream=unique_name, key_field="k", records=[])
    (published,) = publish.get_openlineage_facets_on_start().outputs

    task = BaseOperator(
        task_id="reads_and_writes",
        inlets=[Asset(f"nats://{unique_name}")],
        outlets=[
            Asset(f"nats://{unique_name}_DLQ/billing", extra={"nats_conn_id": "nats_lineage"})
        ],
    )
    lineage = OperatorLineage()
    ExtractorManager().extract_inlets_and_outlets(lineage, task)
    (read,), (written,) = lineage.inputs, lineage.outputs
    assert (read.namespace, read.name) == (published.namespace, published.name)
    assert (read.namespace, read.name) == ("nats://nats-1.example:4333", unique_name)
    # the path names a group or subject of the one stream; the extra picks the connection
    assert (written.namespace, written.name) == ("nats://nats-9.example:4222", f"{unique_name}_DLQ")
    # hook lineage: the hook that reported the asset gives the connection
    hooked = translate_airflow_asset(Asset(f"nats://{unique_name}"), NatsHook("nats_lineage"))
    assert (hooked.namespace, hooked.name) == ("nats://nats-9.example:4222", unique_name)
    shown = "".join(Serde.to_json(d) for d in (read, written, hooked))
    for secret in (*SECRETS.values(), "alice"):
        assert secret not in shown
    # a connection that cannot be read: left out, never a made-up namespace
    missing = Asset(f"nats://{unique_name}", extra={"nats_conn_id": "nats_nowhere"})
    assert translate_airflow_asset(missing, None) is None
