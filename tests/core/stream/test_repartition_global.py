"""A stream published in global order (issue 18 part 1) is not repartitioned silently: the
global-order publisher and reader follow one layout, so `repartition` refuses it, saying
why and what to do, and changes nothing. The check is global order's
(`refuse_global_order`), which the CLI and the operator hand `repartition` as its guard."""

from __future__ import annotations

import asyncio

import nats
import pytest

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.repartition import repartition


def test_a_stream_published_in_global_order_is_not_repartitioned(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url

    async def setup() -> None:
        nc = await nats.connect(url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=4, storage="memory"))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                for i in range(8):
                    await pub.publish(f"k{i}", b"x")
        finally:
            await nc.close()

    async def attempt() -> tuple[str, int]:
        nc = await nats.connect(url)
        try:
            with pytest.raises(ConfigError) as err:
                await repartition(nc, unique_name, 8)
            return str(err.value), (await describe(nc, unique_name)).partitions
        finally:
            await nc.close()

    asyncio.run(setup())
    msg, partitions = asyncio.run(attempt())
    assert "global order" in msg and f"nor_{unique_name}_global" in msg, msg
    assert partitions == 4
    capsys.readouterr()
    code = cli.main(["repartition", "--stream", unique_name, "--partitions", "8", "--server", url])
    out = capsys.readouterr()
    assert code == 2 and "global order" in out.err, (code, out.err)
