"""publish_run reads the stream's layout twice: when it opens the run ledger (what the run's
record is begun for, and which positions an earlier attempt stored) and when its publisher
starts. A repartition in between used to start the publisher on the new layout with the
old layout's positions to pass over: it passed over records of the new partitions that
were never stored, and recorded the run complete. Now that attempt sends nothing and the
run begins again on the new layout, so every record is stored once (real nats-server; the
repartition is the real one, run just before the publisher's own start)."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from streamcheck import read_stream

from airflow_nats_ordered.core.publish import runs
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.runs import RunLedger, publish_run
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.inputs.files import records_from_rows

KEYS, N = 6, 120


def _rows():
    return [{"k": f"k{i % KEYS}", "i": i} for i in range(N)]


def test_a_run_whose_stream_is_repartitioned_as_its_publisher_starts_stores_each_record_once(
    shared_nats_server, unique_name, monkeypatch
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
        switched = []

        class SwitchingFirst(OrderedPublisher):
            async def start(self) -> None:
                if not switched:  # after publish_run read the ledger, before the publisher
                    switched.append(await repartition(nc, unique_name, 8))
                await super().start()

        monkeypatch.setattr(runs, "OrderedPublisher", SwitchingFirst)
        result = await asyncio.wait_for(
            publish_run(
                nc, unique_name, records_from_rows(_rows(), key_field="k"), producer_id="run-1"
            ),
            120,
        )
        recorded = await (await RunLedger.open(nc, unique_name)).get("run-1")
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return switched, result, recorded, stored

    switched, result, recorded, stored = asyncio.run(main())
    assert switched, "the repartition did not run"
    per_key: dict[str, list[int]] = {}
    for m in stored:
        per_key.setdefault(m.key, []).append(json.loads(m.data)["i"])
    assert len(stored) == N, f"{len(stored)} records stored of {N}; run: {result.record}"
    assert result.record.status == "complete" and result.record.epoch == 1, result.record
    assert recorded is not None and recorded.before_switch["epoch"] == 0
    for k in range(KEYS):
        assert per_key[f"k{k}"] == list(range(k, N, KEYS))
