"""Repartitioning a stream (issue 18 part 2): the switch itself, its refusals, and 4 -> 8
while a publisher publishes and two in-process workers process (every key in order)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import nats
import pytest

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.errors import (
    ConfigError,
    PartitionMismatchError,
    StreamNotFoundError,
)
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.layout import GROUP_EPOCH_KEY
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.repartition import (
    RepartitionRunning,
    layout_refusal,
    lock_bucket,
    repartition,
)
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

KEYS = 12


def check_in_order(seen: dict[str, list[int]], rounds: int) -> None:
    """Every key's values 0..rounds-1 all seen, each re-delivery a contiguous replay of an
    already delivered suffix (in-order, at-least-once), never a value before an earlier one
    was first seen."""
    for key, v in seen.items():
        assert sorted(set(v)) == list(range(rounds)), f"{key}: lost values: {v}"
        high = -1
        for i, x in enumerate(v):
            prev = v[i - 1] if i else -1
            if x == prev + 1:
                high = max(high, x)
                continue
            assert x <= high and prev == high, f"{key}: out of order: {v}"
    assert len(seen) == KEYS


async def _until(cond, timeout=90.0):
    t0 = time.monotonic()
    while not await cond():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        await asyncio.sleep(0.1)


def test_repartition_refuses_bad_requests_with_what_to_do(shared_nats_server, unique_name, capsys):
    url = shared_nats_server.url

    async def setup():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(unique_name, partitions=4, storage="memory"))
        with pytest.raises(ConfigError, match="already has 4 partitions"):
            await repartition(nc, unique_name, 4)
        with pytest.raises(ConfigError, match="from 1 to 4096"):
            await repartition(nc, unique_name, 0)
        with pytest.raises(StreamNotFoundError, match="does not exist"):
            await repartition(nc, unique_name + "x", 8)
        # another repartition holds the lock
        kv = await nc.jetstream().create_key_value(bucket=lock_bucket(unique_name), ttl=300)
        await kv.create("lock", json.dumps({"partitions": 6, "host": "h", "pid": 1}).encode())
        with pytest.raises(RepartitionRunning, match="already running .*to 6 partitions"):
            await repartition(nc, unique_name, 8)
        await kv.delete("lock")
        old = await describe(nc, unique_name)
        await nc.close()
        return old

    old = asyncio.run(setup())
    base = ["repartition", "--stream", unique_name, "--server", url]
    assert cli.main([*base, "--partitions", "4"]) == 2
    assert "already has 4 partitions" in capsys.readouterr().err
    assert cli.main([*base, "--partitions", "0"]) == 2
    assert "--partitions" in capsys.readouterr().err
    other = ["repartition", "--stream", f"nope{unique_name}", "--server", url]
    assert cli.main([*other, "--partitions", "3"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([*base, "--partitions", "8", "--json"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["previous_partitions"] == 4 and result["partitions"] == 8
    assert result["epoch"] == 1 and result["subjects"].endswith(".p.e1-7")
    assert "switch point recorded" in out.err  # progress goes to stderr with --json

    async def after():
        nc = await nats.connect(url)
        s = await describe(nc, unique_name)
        assert (s.partitions, s.epoch, s.explicit_subjects) == (8, 1, True)
        assert [(lay.epoch, lay.partitions) for lay in s.layouts] == [(0, 4)]
        # provision with the current count is a no-op, the old count a mismatch naming
        # the way to change it
        now = await provision(nc, StreamSpec(unique_name, partitions=8, storage="memory"))
        assert now.action == "unchanged"
        with pytest.raises(PartitionMismatchError, match="nats-ordered repartition"):
            await provision(nc, StreamSpec(unique_name, partitions=4, storage="memory"))
        # what a publisher that read the old layout is told (see layout_refusal)
        why = await layout_refusal(nc, old, old.subject(3))
        assert why.startswith(f"stream {unique_name} was repartitioned to 8 partitions (epoch 1)")
        assert "Restart the publish" in why
        assert await layout_refusal(nc, s, s.subject(0)) is None  # the layout is current
        await nc.close()

    asyncio.run(after())


def test_4_to_8_while_publishing_and_two_workers_processing_keeps_every_key_in_order(
    shared_nats_server, unique_name
):
    url, stream = shared_nats_server.url, unique_name
    rounds = 24
    seen: dict[str, list[int]] = defaultdict(list)
    partitions_seen: dict[int, set[int]] = defaultdict(set)  # epoch -> partitions

    def handler(msg):
        d = json.loads(msg.data)
        seen[msg.key].append(d["i"])
        partitions_seen[0 if ".e" not in msg.subject else 1].add(msg.partition)

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        workers = [
            Worker(nc, WorkerConfig(stream, "g", member_id=m, lease_ttl=2.0), handler)
            for m in ("w1", "w2")
        ]
        for w in workers:
            await w.start()
        refused: list[str] = []
        published = asyncio.Event()

        async def publish():
            cfg = PublisherConfig(ack_timeout=1.0, delivery_timeout=1.0)
            for r in range(rounds):
                while True:  # a round refused by the switch is published again, same msg-ids
                    try:
                        async with OrderedPublisher(nc, stream, config=cfg) as pub:
                            for k in range(KEYS):
                                body = json.dumps({"i": r}).encode()
                                await pub.publish(f"k{k}", body, msg_id=f"k{k}-{r}")
                        break
                    except PublishError as exc:
                        refused.append(str(exc))
                if r == rounds // 2:
                    published.set()
                await asyncio.sleep(0.05)

        task = asyncio.ensure_future(publish())
        await published.wait()
        result = await repartition(nc, stream, 8)
        assert result.epoch == 1 and result.switch_seq > 0
        await task

        async def all_seen():
            return sum(len(set(v)) for v in seen.values()) == rounds * KEYS

        try:
            await _until(all_seen)
        except AssertionError:
            print("DEBUG", {k: sorted(set(v)) for k, v in seen.items()}, refused[:3])
            for w in workers:
                print("DEBUG", w.member, w.store.epoch, w.problems, w.stats, w.claimed, w.assigned)
            raise
        check_in_order(seen, rounds)
        # both layouts were processed, the new one on all 8 partitions' numbers
        assert partitions_seen[0] and partitions_seen[1]
        assert max(partitions_seen[1]) > 3
        kv = await nc.jetstream().key_value(f"nor_{stream}_g_state")
        assert json.loads((await kv.get(GROUP_EPOCH_KEY)).value)["epoch"] == 1
        for w in workers:
            await w.stop()
        await nc.close()

    asyncio.run(main())
