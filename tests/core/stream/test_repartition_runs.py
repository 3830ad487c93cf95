"""The run ledger across a repartition (issue 18 part 2): a run left partial on the old
layout and published again after the switch stores every record once, each key in order;
its recorded positions of the old layout's partitions are not taken for the new one's."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from streamcheck import read_stream

from airflow_nats_ordered.core.publish.runs import RunLedger, publish_run
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.inputs.files import records_from_rows

KEYS, N = 6, 120


def _rows():
    return [{"k": f"k{i % KEYS}", "i": i} for i in range(N)]


def test_a_partial_run_of_the_old_layout_completes_on_the_new_one_once_and_in_order(
    shared_nats_server, unique_name
):
    async def main():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4, storage="memory"))

        def cut(rows):  # the first attempt dies after 50 records
            for n, rec in enumerate(records_from_rows(rows, key_field="k")):
                if n == 50:
                    raise RuntimeError("killed")
                yield rec

        with pytest.raises(RuntimeError):
            await publish_run(nc, unique_name, cut(_rows()), producer_id="run-1")
        first = await (await RunLedger.open(nc, unique_name)).get("run-1")
        assert first.status == "partial" and sum(first.acked_per_partition.values()) == 50
        await repartition(nc, unique_name, 8)
        result = await publish_run(
            nc, unique_name, records_from_rows(_rows(), key_field="k"), producer_id="run-1"
        )
        assert result.record.status == "complete" and result.record.epoch == 1
        assert result.record.before_switch["epoch"] == 0
        stored = await read_stream(nc, unique_name)
        # every record once; per key, stream order (the order a group applies them in:
        # the old layout's records all come before the new one's) is the input order
        assert len(stored) == N
        per_key: dict[str, list[int]] = {}
        for m in stored:
            per_key.setdefault(m.key, []).append(json.loads(m.data)["i"])
        for k in range(KEYS):
            assert per_key[f"k{k}"] == list(range(k, N, KEYS))
        # the marks name the new layout's partitions, the old ones' records lie before them
        assert result.record.high_water_marks and max(result.record.high_water_marks) <= 7
        await nc.close()

    asyncio.run(main())
