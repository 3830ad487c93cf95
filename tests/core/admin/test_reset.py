"""Resetting a group's positions (Kafka's --reset-offsets), fenced against running members
(real nats-server, real workers)."""

from __future__ import annotations

import asyncio
import json
import re

import nats
import pytest

from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.admin.reset import reset_group
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


async def _publish(nc, stream: str, n: int, start: int = 0) -> dict[int, int]:
    async with OrderedPublisher(nc, stream) as pub:
        for i in range(start, start + n):
            await pub.publish(f"k{i % 10}", json.dumps({"i": i}).encode())
    return {p.partition: p.last_seq for p in pub.summary.partitions if p.last_seq}


def _cfg(stream: str, **kw) -> WorkerConfig:
    return WorkerConfig(stream, "g", member_id="r", lease_ttl=2.0, commit_interval=0.1, **kw)


def test_rewind_under_running_members_replays_everything_in_order(nats_url, unique_name):
    seen: list[int] = []

    async def handler(msg):
        seen.append(json.loads(msg.data)["i"])

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=3))
        marks = await _publish(nc, unique_name, 150)
        async with WorkerPool(nats_url, _cfg(unique_name), handler, size=2) as pool:
            await wait_drained(nc, unique_name, "g", marks=marks, timeout=30)
            first = list(seen)
            reset = await reset_group(nc, unique_name, "g", to="earliest", confirm=True)
            await asyncio.sleep(0.5)
            await wait_drained(nc, unique_name, "g", marks=marks, timeout=30)
            await pool.wait_assigned(10)
            lag = await read_lag(nc, unique_name, "g")
        await nc.close()
        return first, reset, lag

    first, reset, lag = asyncio.run(go())
    assert sorted(first) == list(range(150))
    assert reset.live_members and all(to < was for was, to in reset.positions.values())
    replay = seen[len(first) :]
    assert sorted(replay) == list(range(150)), "the rewind did not replay every message once"
    per_key: dict[int, list[int]] = {}
    for i in replay:
        per_key.setdefault(i % 10, []).append(i)
    assert all(v == sorted(v) for v in per_key.values()), "the replay broke per-key order"
    assert lag.drained, "a stale commit overwrote the reset position"


def test_skip_to_latest_and_past_a_poison_message(nats_url, unique_name):
    seen: list[int] = []

    def handler(msg):
        i = json.loads(msg.data)["i"]
        if i == 5:
            raise RuntimeError("poison")
        seen.append(i)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        await _publish(nc, unique_name, 20)
        cfg = _cfg(unique_name, poison="block", max_retries=0)
        async with WorkerPool(nats_url, cfg, handler, size=1):
            for _ in range(100):
                lag = await read_lag(nc, unique_name, "g")
                if lag.partitions[0].blocked:
                    break
                await asyncio.sleep(0.1)
            poison_seq = int(re.search(r"blocked at seq (\d+)", lag.partitions[0].blocked)[1])
            # skip the poison message: the next message processed is the one after it
            await reset_group(nc, unique_name, "g", to={0: poison_seq}, confirm=True)
            await wait_drained(nc, unique_name, "g", timeout=30)
            skipped_to = await reset_group(nc, unique_name, "g", to="latest", confirm=True)
            marks = await _publish(nc, unique_name, 5, start=100)
            await wait_drained(nc, unique_name, "g", marks=marks, timeout=30)
        await nc.close()
        return lag, skipped_to

    lag, skipped_to = asyncio.run(go())
    assert lag.partitions[0].blocked
    # at-least-once: the owner of the moment may process a message again after the hand-over
    # a reset forces; in first-seen order, the poison is skipped and nothing else is
    assert list(dict.fromkeys(seen)) == [0, 1, 2, 3, 4, *range(6, 20), *range(100, 105)]
    assert skipped_to.positions[0][1] == 20


def test_reset_refuses_without_confirmation_and_names_bad_partitions(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        with pytest.raises(ConfigError, match="confirm=True"):
            await reset_group(nc, unique_name, "g", to="earliest")
        with pytest.raises(ConfigError, match=r"partitions 0 to 1; \[5\] do not exist"):
            await reset_group(nc, unique_name, "g", to={5: 0}, confirm=True)
        await _publish(nc, unique_name, 10)
        await GroupStore.open(nc, _cfg(unique_name).group_config)
        store = await GroupStore.attach(nc, unique_name, "g")
        await store.reset(0, 3)  # partition 0 at 3 before the bad request
        with pytest.raises(ConfigError, match="past the end would skip"):
            await reset_group(nc, unique_name, "g", to={0: 0, 1: 10_000}, confirm=True)
        lag = await read_lag(nc, unique_name, "g")
        await nc.close()
        return lag

    lag = asyncio.run(go())
    assert lag.partitions[0].committed == 3, "a refused reset changed some partitions"
