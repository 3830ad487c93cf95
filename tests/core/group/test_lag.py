"""Lag is exact (issue 28 item 6): ``status``, ``group list`` and the ``_lag`` metrics give the
number of records after each committed position, whatever the other partitions published
in between, across a repartition, and on a stream whose limits removed records. Real
nats-server, real workers; the metric is scraped from a member's own endpoint."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable

import nats
from prometheus_client.parser import text_string_to_metric_families

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.admin.drain import read_lag
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import (
    StreamSpec,
    describe,
    partition_stats,
    provision,
)
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.members.metrics import serve_member

#: bound on every wait for workers to commit (a loaded 2-core machine)
DEADLINE = 180.0


async def _publish(nc, stream: str, items: Iterable[int]) -> Counter[int]:
    """Publish record ``i`` for each item (key ``k<i % 37>``); records per partition."""
    per: Counter[int] = Counter()
    async with OrderedPublisher(nc, stream) as pub:
        for i in items:
            per[await pub.publish(f"k{i % 37}", json.dumps({"i": i}).encode())] += 1
    return per


def _cfg(stream: str) -> WorkerConfig:
    # a commit after every record: a partition whose handler then sticks has committed
    # everything before (and the stuck handler is cancelled at stop after 1 s)
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_every=1, stop_timeout=1.0)


def _handler(up_to: int):
    """Processes records ``i < up_to``, then sticks on the first later one of each
    partition (so the partition's committed position stops right before it)."""

    async def handle(msg) -> None:
        if json.loads(msg.data)["i"] >= up_to:
            await asyncio.Event().wait()

    return handle


async def _committed(nc, stream: str) -> dict[int, int]:
    """The group's committed positions (partitions that committed something)."""
    snap = await (await GroupStore.attach(nc, stream, "g")).snapshot()
    return {p: c.seq for p, c in snap.commits.items() if c.seq}


async def _lasts(nc, stream: str) -> dict[int, int]:
    """Each non-empty partition's last sequence."""
    return {s.partition: s.last_seq for s in await partition_stats(nc, stream) if s.last_seq}


async def _run_worker(nc, stream: str, up_to: int, until: dict[int, int], scrape=None):
    """Run one worker processing records ``i < up_to`` until the committed positions are
    ``until``; with ``scrape``, return its /metrics samples read while it runs (stuck)."""
    w = Worker(nc, _cfg(stream), _handler(up_to))
    await w.start()
    server, _ = serve_member(w, nc, 0)
    samples = None
    try:
        deadline = time.monotonic() + DEADLINE
        while await _committed(nc, stream) != until:
            assert time.monotonic() < deadline, (await _committed(nc, stream), until)
            await asyncio.sleep(0.2)
        if scrape:
            samples = await asyncio.to_thread(_scrape, server.port)
    finally:
        server.close()
        await w.stop()
    return samples


def _scrape(port: int) -> dict[tuple[str, str], float]:
    """``(name, partition label or "")`` -> value of every sample of the member's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        (s.name, s.labels.get("partition", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _status(url: str, stream: str, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["status", "--stream", stream, "--group", "g", "--json", "--server", url]) == 0
    return json.loads(capsys.readouterr().out)


def _listed(url: str, stream: str, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["group", "list", "--stream", stream, "--json", "--server", url]) == 0
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    return group


def _check_everywhere(url, stream, capsys, samples, want: dict[int, int]) -> None:
    """status --json, group list --json and the member's metrics all give ``want``
    (partition -> records after its committed position) and its sum."""
    total = sum(want.values())
    st = _status(url, stream, capsys)
    assert st["total_lag"] == total
    assert {p["partition"]: p["lag"] for p in st["partitions"]} == want, st["partitions"]
    assert _listed(url, stream, capsys)["total_lag"] == total
    if samples is not None:
        assert samples[("nats_ordered_group_lag", "")] == total
        got = {int(p): v for (n, p), v in samples.items() if n == "nats_ordered_partition_lag"}
        assert got == want


def test_lag_is_the_exact_count_after_each_committed_position(nats_url, unique_name, capsys):
    """A group drains 200 records, its worker stops, 10,000 more are published: the lag is
    10,000, not the stream sequences since the commits (10,200 and more); then after a
    partial run, and across a repartition (old-layout records left plus every new one)."""
    url, stream, P = nats_url, unique_name, 8

    async def drained_200_then_10000() -> tuple[Counter[int], object]:
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=P))
        await _publish(nc, stream, range(200))
        await _run_worker(nc, stream, 200, await _lasts(nc, stream))  # drained, stopped
        later = await _publish(nc, stream, range(200, 10_200))
        assert sum(later.values()) == 10_000
        # a member stuck on the first new record of each partition serves the metric
        samples = await _run_worker(nc, stream, 200, await _committed(nc, stream), scrape=True)
        await nc.close()
        return later, samples

    later, samples = asyncio.run(drained_200_then_10000())
    _check_everywhere(url, stream, capsys, samples, {p: later[p] for p in range(P)})

    async def processed_up_to_5200() -> tuple[Counter[int], object]:
        nc = await nats.connect(url)
        # the commits a partial run reaches: each partition's last record i < 5200
        behind, until = _split(await _scan(nc, stream), 5200)
        samples = await _run_worker(nc, stream, 5200, until, scrape=True)
        await nc.close()
        return behind, samples

    behind, samples = asyncio.run(processed_up_to_5200())
    assert sum(behind.values()) == 5000
    _check_everywhere(url, stream, capsys, samples, {p: behind[p] for p in range(P)})

    async def repartitioned() -> tuple[object, int]:
        nc = await nats.connect(url)
        await repartition(nc, stream, 4)
        new = await _publish(nc, stream, range(10_200, 11_200))  # the new layout
        assert sum(new.values()) == 1000
        lag = await read_lag(nc, stream, "g")
        assert (lag.epoch, lag.stream_epoch, lag.later) == (0, 1, 1000)
        # still on the old layout: its 5,000 records left and all 1,000 new ones
        samples = await _run_worker(nc, stream, 5200, await _committed(nc, stream), scrape=True)
        await nc.close()
        return samples, lag.total_lag

    samples, total = asyncio.run(repartitioned())
    assert total == 6000
    st = _status(url, stream, capsys)
    assert (st["epoch"], st["later_layout_messages"], st["total_lag"]) == (0, 1000, 6000)
    assert {p["partition"]: p["lag"] for p in st["partitions"]} == {p: behind[p] for p in range(P)}
    assert _listed(url, stream, capsys)["total_lag"] == 6000
    assert samples[("nats_ordered_group_lag", "")] == 6000

    async def finished() -> None:
        nc = await nats.connect(url)
        w = Worker(nc, _cfg(stream), _handler(10**9))
        await w.start()
        try:
            deadline = time.monotonic() + DEADLINE
            while not ((lag := await read_lag(nc, stream, "g")).drained and lag.epoch == 1):
                assert time.monotonic() < deadline, lag
                await asyncio.sleep(0.2)
        finally:
            await w.stop()
        await nc.close()

    asyncio.run(finished())
    st = _status(url, stream, capsys)
    assert (st["epoch"], st["total_lag"], st["drained"]) == (1, 0, True)
    assert _listed(url, stream, capsys)["total_lag"] == 0


async def _scan(nc, stream: str) -> list[tuple[int, int, int]]:
    """``(partition, stream sequence, i)`` of every record of the stream's current layout,
    read with an ordered consumer per partition."""
    described = await describe(nc, stream)
    js = nc.jetstream()
    counts = (await js.stream_info(stream, subjects_filter=">")).state.subjects or {}
    out = []
    for p in range(described.partitions):
        subject = described.subject(p)
        if not counts.get(subject):
            continue
        sub = await js.subscribe(subject, ordered_consumer=True)
        try:
            for _ in range(counts[subject]):
                msg = await sub.next_msg(timeout=30)
                out.append((p, msg.metadata.sequence.stream, json.loads(msg.data)["i"]))
        finally:
            await sub.unsubscribe()
    return out


def _split(records: list[tuple[int, int, int]], i: int) -> tuple[Counter[int], dict[int, int]]:
    """Per partition: how many records have an ``i`` of at least ``i`` (the lag once the
    records below are processed), and the sequence of its last record below ``i``."""
    behind: Counter[int] = Counter(p for p, _, at in records if at >= i)
    last: dict[int, int] = {}
    for p, seq, at in records:
        if at < i:
            last[p] = max(last.get(p, 0), seq)
    return behind, last


def test_lag_counts_the_records_still_stored_when_limits_removed_older_ones(
    nats_url, unique_name, capsys
):
    """max_msgs removed records: a committed position below the stream's first sequence
    lags by the partition's records still stored (the removed ones can never be processed),
    and a position inside the stored range by the records after it."""
    url, stream, P = nats_url, unique_name, 4

    async def below_first_then_inside() -> Counter[int]:
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=P, max_msgs=1000))
        await _publish(nc, stream, range(200))
        await _run_worker(nc, stream, 200, await _lasts(nc, stream))
        await _publish(nc, stream, range(200, 1200))  # the oldest 200 records go
        info = await nc.jetstream().stream_info(stream)
        first = int(info.state.first_seq)
        committed = await _committed(nc, stream)
        assert first == 201 and all(c < first for c in committed.values()), committed
        stored, _ = _split(await _scan(nc, stream), 0)
        lag = await read_lag(nc, stream, "g")
        below = {p.partition: p.lag for p in lag.partitions}
        assert below == {p: stored[p] for p in range(P)} and lag.total_lag == 1000
        behind, until = _split(await _scan(nc, stream), 700)
        await _run_worker(nc, stream, 700, until)
        await nc.close()
        return behind

    behind = asyncio.run(below_first_then_inside())
    assert sum(behind.values()) == 500
    _check_everywhere(url, stream, capsys, None, {p: behind[p] for p in range(P)})


def test_the_protocol_pages_worked_example_of_the_count_holds(nats_url, unique_name):
    """docs/protocol.md 9.2: partition 0 of a 3-partition stream holds sequences 1, 4, ...,
    28; after 5 it lags by 8, after 28 by 0; once the oldest records are purged, a
    position below the first sequence counts what is still stored."""
    from airflow_nats_ordered.core.group.lag import records_after  # the definition under test

    async def main() -> None:
        nc = await nats.connect(nats_url)
        described = (await provision(nc, StreamSpec(unique_name, partitions=3))).stream
        js = nc.jetstream()
        for i in range(30):
            await js.publish(described.subject(i % 3), b"x")
        s0 = described.subject(0)
        assert await records_after(nc, unique_name, s0, 5) == 8
        assert await records_after(nc, unique_name, s0, 0) == 10
        assert await records_after(nc, unique_name, s0, 28) == 0
        assert await records_after(nc, unique_name, s0, 27) == 1
        await js.purge_stream(unique_name, keep=20)  # sequences 11..30 stay
        assert await records_after(nc, unique_name, s0, 5) == 6  # 13, 16, ..., 28
        await nc.close()

    asyncio.run(main())
