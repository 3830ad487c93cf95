"""A global sequence from the Spark sink (issue 18 part 1): ``write_ordered(...,
global_order=True)`` stamps every row with ``Nats-Global-Seq`` in (``order_by``,
tie-breaker) order over the whole DataFrame. A real ``GlobalOrderReader`` merging the
stream's partitions hands the rows over in that one order across all keys; a core
global-order publisher after it continues the order; a publisher holding the sequencer
claim makes the write refuse before any Spark job runs."""

from __future__ import annotations

import asyncio
import json
import random
import time

import nats
import pytest
from spark_helpers import on_server

from airflow_nats_ordered.core.order.reader import GlobalOrderReader
from airflow_nats_ordered.core.order.sequencer import SequencerBusy
from airflow_nats_ordered.core.order.watermarks import HDR_GLOBAL_SEQ, GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import write_ordered  # noqa: E402

SCHEMA = "k string, ts long, i long"


def _rows(n: int, keys: int, seed: int) -> list[dict]:
    """Event times shuffled over rows and keys: sorted by ``ts`` the keys interleave."""
    times = list(range(1_000, 1_000 + n))
    random.Random(seed).shuffle(times)
    return [{"k": f"key-{i % keys}", "ts": t, "i": i} for i, t in enumerate(times)]


async def _read_all(url: str, stream: str, count: int) -> list[tuple[int, dict]]:
    """(global sequence, row) of ``count`` records, in the order a global-order reader
    hands them over."""
    nc = await nats.connect(url)
    got: list[tuple[int, dict]] = []
    reader = GlobalOrderReader(
        nc, stream, "audit", lambda m: got.append((m.global_seq, json.loads(m.data)))
    )
    await reader.start()
    deadline = time.monotonic() + 120
    while len(got) < count:
        assert time.monotonic() < deadline, f"the reader handed over {len(got)} of {count}"
        await asyncio.sleep(0.1)
    await reader.stop()
    await nc.close()
    return got


def test_write_ordered_global_order_is_one_order_over_all_keys(spark, nats_url, unique_name):
    on_server(nats_url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=4)))
    rows = _rows(240, keys=24, seed=7)
    df = spark.createDataFrame(rows, SCHEMA).repartition(3)  # input order is not ts order
    rec = write_ordered(
        df,
        stream=unique_name,
        key="k",
        order_by="ts",
        producer_id="spark-global",
        global_order=True,
        connection={"url": nats_url},
    )
    assert rec.status == "complete" and rec.acked == 240, rec.to_dict()

    async def after(nc):  # a core global-order publisher continues the order
        async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
            for j in range(20):
                payload = json.dumps({"k": f"key-{j}", "ts": 5_000 + j, "i": 1_000 + j})
                await pub.publish(f"key-{j}", payload.encode())

    on_server(nats_url, after)
    got = asyncio.run(_read_all(nats_url, unique_name, 260))
    seqs = [g for g, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == 260
    # the Spark run's rows in ts order over all keys (the reader's order), then the core's
    assert [r["ts"] for _, r in got[:240]] == sorted(r["ts"] for r in rows)
    assert [r["i"] for _, r in got[240:]] == list(range(1_000, 1_020))

    async def watermarks(nc):
        kv = await nc.jetstream().key_value(watermark_bucket(unique_name))
        return {k: json.loads((await kv.get(k)).value)["g"] for k in await kv.keys()}

    marks = on_server(nats_url, watermarks)
    assert set(marks) == {"w.0", "w.1", "w.2", "w.3"}
    assert min(marks.values()) > seqs[239]  # every partition promised past the Spark run


def test_a_held_sequencer_claim_refuses_the_write_before_any_job(spark, nats_url, unique_name):
    on_server(nats_url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=2)))
    df = spark.createDataFrame(_rows(20, keys=4, seed=1), SCHEMA)
    holding = asyncio.Event()
    done = asyncio.Event()

    async def scenario():
        nc = await nats.connect(nats_url)
        async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()):
            holding.set()
            with pytest.raises(SequencerBusy) as err:
                await asyncio.to_thread(
                    write_ordered,
                    df,
                    stream=unique_name,
                    key="k",
                    order_by="ts",
                    producer_id="refused",
                    global_order=True,
                    connection={"url": nats_url},
                )
            done.set()
        ledger = await RunLedger.open(nc, unique_name)
        record = await ledger.get("refused")
        info = await nc.jetstream().stream_info(unique_name)
        await nc.close()
        return str(err.value), record, info.state.messages

    text, record, stored = asyncio.run(scenario())
    assert "another global-order publisher" in text
    assert record is None and stored == 0  # nothing begun, nothing sent


def test_global_order_refuses_a_kafka_array_headers_column(spark, nats_url, unique_name):
    on_server(nats_url, lambda nc: provision(nc, StreamSpec(unique_name, partitions=2)))
    df = spark.createDataFrame(
        [{"k": "a", "ts": 1, "headers": [{"key": "h", "value": "v"}]}],
        "k string, ts long, headers array<struct<key:string,value:string>>",
    )
    with pytest.raises(Exception, match="map_from_entries") as err:
        write_ordered(
            df,
            stream=unique_name,
            key="k",
            order_by="ts",
            producer_id="array-headers",
            global_order=True,
            connection={"url": nats_url},
        )
    assert HDR_GLOBAL_SEQ in str(err.value)

    async def free(nc):  # the claim was given back: a core publisher may stamp now
        async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
            await pub.publish("a", b"x")

    on_server(nats_url, free)
