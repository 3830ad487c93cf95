"""The publisher's guarantees under failure, tested by breaking real servers mid-publish.

After each fault, everything published is compared with everything stored: every
acknowledged record is stored exactly once, each partition (hence each key) holds its input
in input order without gaps, and every record that was not stored was reported.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from streamcheck import check_stored, make_records, read_stream, stored_problems

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision


async def _connect(urls):
    return await nats.connect(
        servers=urls if isinstance(urls, list) else [urls],
        reconnect_time_wait=0.2,
        max_reconnect_attempts=-1,
        connect_timeout=2,
    )


async def _publish_with_fault(nc, stream, records, when_acked, fault, **knobs):
    """Publish ``records``; run ``fault()`` once ``when_acked`` records are acknowledged."""
    pub = OrderedPublisher(nc, stream, **knobs)
    await pub.start()
    fired = asyncio.Event()

    async def watch():
        while pub.acked < when_acked:
            await asyncio.sleep(0.005)
        await fault()
        fired.set()

    watcher = asyncio.ensure_future(watch())
    error = None
    try:
        for k, body in records:
            await pub.publish(k, body)
        await fired.wait()
        summary = await pub.flush()
    except PublishError as exc:
        error, summary = exc, exc.summary
    finally:
        watcher.cancel()
        await pub.close(raise_on_failure=False)
    return summary, error


@pytest.mark.chaos
def test_server_sigkill_mid_publish_loses_nothing_and_keeps_order(nats_server, unique_name):
    records = make_records(60_000, keys=500)

    async def go():
        nc = await _connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=16))

        async def crash():
            nats_server.kill()
            await asyncio.sleep(1.0)
            await asyncio.to_thread(nats_server.restart)

        summary, error = await _publish_with_fault(
            nc, unique_name, records, 20_000, crash, ack_timeout=2.0, delivery_timeout=60
        )
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, error, stored

    summary, error, stored = asyncio.run(go())
    assert error is None, error
    assert sum(p.retries for p in summary.partitions) > 0, "the crash was not noticed"
    assert summary.acked == len(records) and summary.failed == 0
    counts = check_stored(records, stored, 16, unique_name.lower())
    assert sum(counts.values()) == len(records)


@pytest.mark.chaos
@pytest.mark.cluster
def test_stream_leader_killed_mid_publish_in_r3_cluster(nats_cluster, unique_name):
    records = make_records(40_000, keys=400)

    async def go():
        nc = await _connect(nats_cluster.urls)
        await provision(nc, StreamSpec(unique_name, partitions=8, replicas=3))
        killed = []

        async def kill_leader():
            idx = await asyncio.to_thread(nats_cluster.stream_leader, unique_name)
            meta = await asyncio.to_thread(nats_cluster.meta_leader)
            killed.append(idx)
            killed.append(meta and nats_cluster.server_index_by_name(meta))
            await asyncio.to_thread(nats_cluster.kill, idx)

        summary, error = await _publish_with_fault(
            nc,
            unique_name,
            records,
            10_000,
            kill_leader,
            ack_timeout=2.0,
            delivery_timeout=60,
        )
        stored = await read_stream(nc, unique_name)
        new_leader = await asyncio.to_thread(nats_cluster.stream_leader, unique_name)
        await nc.close()
        return summary, error, stored, killed, new_leader

    summary, error, stored, killed, new_leader = asyncio.run(go())
    acked = {p.partition: p.acked for p in summary.partitions}
    problems = stored_problems(records, stored, 8, unique_name.lower(), acked=acked)
    if error is not None:
        problems.insert(0, f"flush raised: {error}")
    if not killed or new_leader == killed[0]:
        problems.append(f"the leader did not change: killed {killed}, leader now {new_leader}")
    if summary.acked != len(records) or summary.failed:
        problems.append(f"acked {summary.acked} and failed {summary.failed} of {len(records)}")
    if len(stored) != len(records):
        problems.append(f"stored {len(stored)} of {len(records)} records")
    assert not problems, (
        f"killed stream leader: server {killed[:1]} (meta leader then: server "
        f"{killed[1:]}), new stream leader: server {new_leader}; "
        f"acked {summary.acked}, stored {len(stored)}, retries "
        f"{sum(p.retries for p in summary.partitions)}; per partition (acked/stored): "
        + ", ".join(f"{p.partition}: {p.acked}/{p.stored}" for p in summary.partitions)
        + "\n"
        + "\n".join(problems)
    )


@pytest.mark.chaos
def test_server_down_past_delivery_timeout_reports_every_unstored_record(nats_server, unique_name):
    records = make_records(30_000, keys=300)

    async def go():
        nc = await _connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=8))

        async def crash():
            nats_server.kill()

        summary, error = await _publish_with_fault(
            nc,
            unique_name,
            records,
            8_000,
            crash,
            ack_timeout=0.5,
            delivery_timeout=2.0,
            max_pending=5_000,
        )
        await asyncio.to_thread(nats_server.restart)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, error, stored

    summary, error, stored = asyncio.run(go())
    assert isinstance(error, PublishError)
    assert summary.failed > 0 and summary.acked >= 8_000
    assert summary.accepted == len(records)
    assert summary.acked + summary.failed == summary.accepted  # nothing unaccounted for
    for p in summary.partitions:
        if p.failed:
            assert f"partition {p.partition}: producer seq {p.acked + 1}..{p.accepted}" in str(
                error
            ) or "..." in str(error)
    acked = {p.partition: p.acked for p in summary.partitions}
    counts = check_stored(records, stored, 8, unique_name.lower(), acked=acked)
    # stored records beyond the acknowledged ones are possible (acks lost in the crash), but
    # each partition is still a gap-free prefix of its input
    assert all(counts[p] >= acked[p] for p in acked)


@pytest.mark.chaos
def test_server_paused_past_ack_timeout_then_resumed(nats_server, unique_name):
    """A stalled (not dead) server: the old batches' messages arrive late, after the
    publisher has started resending them in new batches. Nothing may be stored twice or
    out of order."""
    records = make_records(40_000, keys=400)

    async def go():
        nc = await _connect(nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=8))

        async def stall():
            nats_server.pause()
            await asyncio.sleep(2.5)
            nats_server.resume()

        summary, error = await _publish_with_fault(
            nc, unique_name, records, 10_000, stall, ack_timeout=1.0, delivery_timeout=60
        )
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, error, stored

    summary, error, stored = asyncio.run(go())
    assert error is None, error
    assert sum(p.retries for p in summary.partitions) > 0, "the stall was not noticed"
    assert summary.acked == len(records)
    counts = check_stored(records, stored, 8, unique_name.lower())
    assert sum(counts.values()) == len(records)


def test_message_lost_mid_batch_is_stored_before_everything_after_it(
    shared_nats_server, unique_name, monkeypatch
):
    """A message dropped between client and stream while later ones get through (what the
    server's self-protection may do under load) must not let its successors overtake it:
    gap mode 'fail' stops the batch at the gap and the publisher resends from there."""
    from airflow_nats_ordered.core.publish import wire

    records = make_records(5_000, keys=1)  # one key: the whole stream is one ordered sequence
    real_send_frames = wire.send_frames
    sent = {"n": 0, "dropped": 0}
    drop_from = [700, 2_500]  # lose two messages on the wire, from about these on

    async def lossy_send_frames(nc, fast, frames, payload, largest):
        # every message of the publisher passes here, a window of frames at a time
        kept = []
        for i, f in enumerate(frames):
            _, _, _, hlen, tlen = f.partition(b"\r\n")[0].split(b" ")
            if int(tlen) > int(hlen):  # a record, not a commit
                sent["n"] += 1
                # one that later records of the same write follow: they reach the server
                if drop_from and sent["n"] >= drop_from[0] and i + 1 < len(frames):
                    drop_from.pop(0)
                    sent["dropped"] += 1
                    continue
            kept.append(f)
        await real_send_frames(nc, fast, kept, payload, largest)

    monkeypatch.setattr(wire, "send_frames", lossy_send_frames)

    async def go():
        nc = await _connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        async with OrderedPublisher(nc, unique_name, ack_timeout=2.0) as pub:
            for k, body in records:
                await pub.publish(k, body)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return pub.summary, stored

    summary, stored = asyncio.run(go())
    assert sent["dropped"] == 2, sent
    assert summary.partitions[0].retries >= 2
    assert sum(check_stored(records, stored, 1, unique_name.lower()).values()) == len(records)
