"""Structured Streaming into the nats-ordered sink: a checkpointed query stopped in the
middle of a micro-batch (what a killed driver leaves: the batch's offsets are logged, its
commit is not) and restarted from its checkpoint stores every row exactly once, in order."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from spark_helpers import exactly_once_in_order, make_stream, on_server, run_record, stored

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import batch_run_id  # noqa: E402

FILES, PER_FILE = 3, 400


def _hold_batch_one(url: str, stream: str, gate: str):
    """Pass-through step: while ``gate`` exists, micro-batch 1 stops after the sink has
    stored part of it, and waits there (to be stopped)."""

    def step(batches):
        import asyncio
        import os

        import nats
        from pyspark import TaskContext

        async def count() -> int:
            nc = await nats.connect(url)
            try:
                return (await nc.jetstream().stream_info(stream)).state.messages
            finally:
                await nc.close()

        batch = TaskContext.get().getLocalProperty("streaming.sql.batchId")
        for n, b in enumerate(batches):
            if batch == "1" and n == 6 and os.path.exists(gate):
                while asyncio.run(count()) <= PER_FILE:
                    time.sleep(0.1)
                time.sleep(120)  # stopped here
            yield b

    return step


def _query(spark, src: Path, checkpoint: Path, url: str, stream: str, gate: str):
    schema = "k string, ts long, i long, pad string"
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(src))
    df = df.mapInArrow(_hold_batch_one(url, stream, gate), df.schema)
    return (
        df.writeStream.format("nats-ordered")
        .option("stream", stream)
        .option("keyColumn", "k")
        # no orderBy: refused on unrouted streaming writes (issue 17 item 6); each micro-batch
        # is one file, one task, whose rows arrive in ts order
        .option("producerId", "events")
        .option("url", url)
        .option("checkpointLocation", str(checkpoint))
    )


def test_streaming_query_stopped_mid_batch_and_restarted_stores_nothing_twice(
    spark, nats_url, unique_name, tmp_path
):
    make_stream(nats_url, unique_name, partitions=4)
    src, checkpoint, gate = tmp_path / "in", tmp_path / "checkpoint", tmp_path / "hold"
    src.mkdir()
    gate.touch()
    rows = []
    for f in range(FILES):
        part = [
            {"k": f"key-{(i * 7) % 23}", "ts": i, "i": i, "pad": "x" * 1000}
            for i in range(f * PER_FILE, (f + 1) * PER_FILE)
        ]
        (src / f"part-{f}.json").write_text("".join(json.dumps(r) + "\n" for r in part))
        rows += part
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "50")
    try:
        first = _query(spark, src, checkpoint, nats_url, unique_name, str(gate)).start()

        async def count(nc) -> int:
            return (await nc.jetstream().stream_info(unique_name)).state.messages

        deadline = time.monotonic() + 60
        while on_server(nats_url, count) <= PER_FILE and time.monotonic() < deadline:
            assert first.exception() is None, first.exception()
            time.sleep(0.1)
        at_stop = on_server(nats_url, count)
        first.stop()
        assert PER_FILE < at_stop < FILES * PER_FILE, at_stop
        assert not (checkpoint / "commits" / "1").exists(), "batch 1 was committed"
        assert (
            run_record(nats_url, unique_name, batch_run_id("events", 0, first.id)).status
            == "complete"
        )

        gate.unlink()
        second = (
            _query(spark, src, checkpoint, nats_url, unique_name, str(gate))
            .trigger(availableNow=True)
            .start()
        )
        second.awaitTermination(180)
        assert second.exception() is None, second.exception()
        assert second.id == first.id  # one query: its checkpoint keeps its id
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = stored(nats_url, unique_name)
    assert exactly_once_in_order(rows, got, "k", "ts") == []
    replayed = run_record(nats_url, unique_name, batch_run_id("events", 1, first.id))
    assert replayed is not None and replayed.status == "complete"
    assert replayed.duplicates >= at_stop - PER_FILE  # what the stopped attempt had stored
    last = run_record(nats_url, unique_name, batch_run_id("events", 2, first.id))
    assert last is not None and last.status == "complete" and last.acked == PER_FILE
