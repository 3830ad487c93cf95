"""The publisher's one sender task (core/publish/sender.py), which serves every parked
partition lane in one pass and one write: what it sends is still stored exactly once and in
order when that write fails, and a lane it serves still commits after ``linger``."""

from __future__ import annotations

import asyncio

import nats
from nats import errors as nats_errors
from streamcheck import check_stored, make_records, read_stream

from airflow_nats_ordered.core.publish import wire
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


def _subjects(frames: list[bytes]) -> set[bytes]:
    return {f.split(b" ", 2)[1] for f in frames}


def test_a_failed_write_for_several_partitions_is_resent_in_order(
    shared_nats_server, unique_name, monkeypatch
):
    """One write carrying windows of several partitions (only the sender writes those) is
    refused twice: each of those partitions resends from its first unacknowledged record,
    and every record is stored once, in order, none reported failed."""
    partitions = 8
    records = make_records(8_000, keys=200)
    real_send_frames = wire.send_frames
    refused = {"writes": 0, "partitions": 0}

    async def refusing_send_frames(nc, fast, frames, payload, largest):
        subjects = _subjects(frames)
        if len(subjects) > 1 and refused["writes"] < 2:
            refused["writes"] += 1
            refused["partitions"] += len(subjects)
            raise nats_errors.OutboundBufferLimitError  # nothing of it was queued
        await real_send_frames(nc, fast, frames, payload, largest)

    monkeypatch.setattr(wire, "send_frames", refusing_send_frames)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=partitions))
        async with OrderedPublisher(nc, unique_name) as pub:
            for k, body in records:
                await pub.publish(k, body)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return pub.summary, stored

    summary, stored = asyncio.run(go())
    assert refused["writes"] == 2, "no write carried more than one partition's frames"
    assert summary.failed == 0 and summary.acked == len(records)
    assert sum(p.retries for p in summary.partitions) >= refused["partitions"]
    counts = check_stored(records, stored, partitions, unique_name.lower())
    assert sum(counts.values()) == len(records)


def test_a_lane_served_by_the_sender_commits_after_linger_not_the_ack_timeout(
    shared_nats_server, unique_name
):
    """More records than a window (one partition: flow 500, a window of 1,000): the sender
    sends the rest as acknowledgements come and empties the queue. The batch must then be
    committed after ``linger`` (the last record, past the last flow acknowledgement, is
    acknowledged without a flush), not left until ``ack_timeout`` (80 s here) runs out."""
    records = make_records(2_001, keys=1)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        pub = OrderedPublisher(nc, unique_name, ack_timeout=80.0, delivery_timeout=30.0)
        await pub.start()
        try:
            for k, body in records:
                await pub.publish(k, body)
            deadline = asyncio.get_running_loop().time() + 60.0
            while pub.acked < len(records):  # no flush: only linger commits the batches
                assert asyncio.get_running_loop().time() < deadline, (
                    f"{pub.acked} of {len(records)} acknowledged after 60 s without a flush"
                )
                await asyncio.sleep(0.05)
            summary = await pub.flush()
        finally:
            await pub.close(raise_on_failure=False)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, stored

    summary, stored = asyncio.run(go())
    assert summary.failed == 0 and summary.acked == len(records)
    assert sum(check_stored(records, stored, 1, unique_name.lower()).values()) == len(records)


def test_an_unexpected_sender_error_hands_its_lanes_back_and_loses_nothing(
    shared_nats_server, unique_name, monkeypatch
):
    """A bug in the sender's pass (here: building a window raises, twice) must not strand
    the lanes of that pass: each is handed back to its own task, resends, and is served by
    the sender again; every record is stored once, in order."""
    from airflow_nats_ordered.core.publish.lane import _Lane

    records = make_records(4_000, keys=80)
    real_window = _Lane.window
    raised = {"n": 0}

    def faulty_window(lane, frames):
        if lane.parked and raised["n"] < 2:  # only the sender builds a parked lane's window
            raised["n"] += 1
            raise RuntimeError("injected sender bug")
        return real_window(lane, frames)

    monkeypatch.setattr(_Lane, "window", faulty_window)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=4))
        async with OrderedPublisher(
            nc, unique_name, ack_timeout=80.0, delivery_timeout=30.0
        ) as pub:
            for k, body in records:
                await pub.publish(k, body)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return pub.summary, stored

    # a stranded lane would wait for its 80 s ack timeout: 60 s is the hang guard
    summary, stored = asyncio.run(asyncio.wait_for(go(), 60.0))
    assert raised["n"] == 2
    assert summary.failed == 0 and summary.acked == len(records)
    assert sum(check_stored(records, stored, 4, unique_name.lower()).values()) == len(records)
