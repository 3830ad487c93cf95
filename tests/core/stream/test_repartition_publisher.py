"""A publisher that started before a repartition is refused by the server (its subjects are
no longer the stream's) and says so, naming the repartition, instead of retrying until its
delivery timeout and reporting lost acknowledgements."""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition


def test_a_publisher_on_the_old_layout_is_told_the_stream_was_repartitioned(
    shared_nats_server, unique_name
):
    async def main() -> tuple[str, int]:
        nc = await nats.connect(shared_nats_server.url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=4, storage="memory"))
            pub = OrderedPublisher(nc, unique_name)
            await pub.start()
            await pub.publish("a", b"1")
            await pub.flush()
            await repartition(nc, unique_name, 8)
            await pub.publish("a", b"2")
            with pytest.raises(PublishError) as err:
                await pub.close()
            return str(err.value), pub.failed
        finally:
            await nc.close()

    msg, failed = asyncio.run(main())
    assert "was repartitioned to 8 partitions (epoch 1)" in msg, msg
    assert "Restart the publish" in msg or "restart the publish" in msg, msg
    assert failed == 1  # the record sent after the switch is reported, not lost silently
