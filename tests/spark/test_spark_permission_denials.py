"""A refused permission, as the Spark sink says it: the option (or variable) that gave the
user, and the publisher role the sink writes as. Against a real server; no Spark JVM (the
sink's NATS calls all run through ``_on_nats``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from permission_accounts import PASSWORD, S, provisioned_server

from airflow_nats_ordered.core.errors import PermissionDenied
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.spark.datasource import _on_nats
from airflow_nats_ordered.spark.options import SinkOptions


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with provisioned_server(tmp_path_factory.mktemp("spark-denials")) as srv:
        yield srv


def test_sink_names_the_user_option_and_the_publisher_role(server: NatsServer) -> None:
    sink = SinkOptions.from_spark(
        {
            "stream": S,
            "keyColumn": "k",
            "producerId": "run-1",
            "url": server.url,
            "user": "reader_a",
        },
        env={"NATS_PASSWORD": PASSWORD},
    )

    async def write(nc) -> None:  # noqa: ANN001 - what a task does with the sink's client
        async with OrderedPublisher(nc, S, producer_id="run-1.t0") as pub:
            await pub.publish("k1", b"row")

    with pytest.raises(PermissionDenied) as info:
        _on_nats(sink, write)
    text = str(info.value)
    assert text.startswith("permission denied: publish to orders.p."), text
    assert "the user given by option user (or NATS_USER) 'reader_a'" in text
    assert f"run `nats-ordered permissions --role publisher --stream {S}`" in text
    assert PASSWORD not in text
