"""``info`` on a repartitioned stream counts every layout (issue 18 part 2): the earlier
layouts' messages are still stored and still read by every group, so a total of the current
layout alone under-reported what the stream holds (50 stored, ``info`` said 10)."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition


def test_info_counts_the_earlier_layouts_messages(shared_nats_server, unique_name, capsys):
    url, stream = shared_nats_server.url, unique_name

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(40):
                await pub.publish(f"k{i}", b"old")
        await repartition(nc, stream, 2)
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(10):
                await pub.publish(f"k{i}", b"new")
        stored = (await nc.jetstream().stream_info(stream)).state.messages
        await nc.close()
        return stored

    stored = asyncio.run(main())
    assert stored == 50
    capsys.readouterr()
    assert cli.main(["info", "--stream", stream, "--server", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["messages"] == stored
    assert sum(s["messages"] for s in info["partition_stats"]) == 10
    (old,) = info["earlier_layouts"]
    assert (old["epoch"], old["partitions"], old["messages"]) == (0, 4, 40)
    assert [s["partition"] for s in old["partition_stats"]] == [0, 1, 2, 3]
    assert old["switch_seq"] == 40
    assert cli.main(["info", "--stream", stream, "--server", url]) == 0
    table = capsys.readouterr().out
    assert "4 partitions (earlier layout)" in table
    total = next(line for line in table.splitlines() if line.strip().startswith("total"))
    assert total.split()[1:] == ["50", "50"], table
