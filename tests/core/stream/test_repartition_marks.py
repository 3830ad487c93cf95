"""Drain marks of an earlier layout after a repartition that shrank the stream (issue 18
part 2): a publisher reported marks for partitions 0-3, the stream went 4 -> 2, and a wait on
those marks must return once the group has applied them and moved to the new layout. The
core wait, the deferrable sensor (its trigger runs the core wait) and the poke-mode sensor
decide with one rule (``core.drain.marks_to_wait``), so they cannot disagree."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from airflow_dags import nats_connection

from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.admin.marks import marks_to_wait
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision, stream_contents
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor
from airflow_nats_ordered.triggers.drain import NatsGroupDrainTrigger

KEYS = 16


def test_marks_at_or_below_the_switch_are_of_an_earlier_layout():
    # covered by the group's move to the current layout, whatever partition they name
    assert marks_to_wait({3: 40, 1: 90, 0: 120}, partitions=2, switch_seq=100, stream="S") == {
        0: 120
    }
    # never repartitioned: every mark counts
    assert marks_to_wait({0: 5, 1: 0}, partitions=2, switch_seq=0, stream="S") == {0: 5, 1: 0}


def test_a_mark_past_the_switch_on_a_partition_the_layout_lacks_is_refused():
    with pytest.raises(ConfigError) as err:
        marks_to_wait({0: 120, 3: 130}, partitions=2, switch_seq=100, stream="S")
    text = str(err.value)
    assert "partitions [3]" in text and "0 to 1" in text and "stream S" in text


def test_a_wait_on_old_layout_marks_returns_after_a_shrinking_repartition(
    shared_nats_server, unique_name, monkeypatch
):
    url, stream = shared_nats_server.url, unique_name
    monkeypatch.setenv("AIRFLOW_CONN_NATS_MARKS", nats_connection(url))
    applied: list[tuple[str, int]] = []

    async def handler(msg):
        applied.append((msg.key, json.loads(msg.data)["i"]))

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        w = Worker(nc, WorkerConfig(stream, "g", member_id="w1", lease_ttl=2.0), handler)
        await w.start()  # the group exists at epoch 0
        await w.wait_assigned(60)
        await w.stop()
        async with OrderedPublisher(nc, stream) as pub:
            for r in range(5):
                for k in range(KEYS):
                    await pub.publish(f"k{k}", json.dumps({"i": r}).encode(), msg_id=f"{k}-{r}")
        # the marks the publisher reported: every partition 0-3 of the old layout
        marks = {s.partition: s.last_seq for s in (await stream_contents(nc, stream)).partitions}
        assert sorted(marks) == [0, 1, 2, 3] and marks[2] and marks[3]
        await repartition(nc, stream, 2)
        w = Worker(nc, WorkerConfig(stream, "g", member_id="w1", lease_ttl=2.0), handler)
        await w.start()
        progress = await wait_drained(nc, stream, "g", marks=marks, timeout=120)
        assert progress.done and progress.waiting_epoch is None
        assert len(set(applied)) == 5 * KEYS
        # the deferrable sensor's trigger runs the same wait on the same marks
        trigger = NatsGroupDrainTrigger(
            stream=stream,
            group="g",
            marks={str(p): m for p, m in marks.items()},
            nats_conn_id="nats_marks",
            timeout=120,
        )
        event = [e.payload async for e in trigger.run()][0]
        assert event["status"] == "success", event
        await w.stop()
        await nc.close()
        return marks

    marks = asyncio.run(main())
    # and the poke-mode sensor: one poke finds every mark met
    sensor = NatsGroupDrainSensor(
        task_id="poked",
        stream=stream,
        group="g",
        nats_conn_id="nats_marks",
        high_water_marks={str(p): m for p, m in marks.items()},
        deferrable=False,
    )
    assert sensor.poke({}), "the poke-mode sensor did not find the old marks met"
