"""Helpers of the Spark tests: a provisioned stream, its contents, its run record."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from streamcheck import Stored, read_stream

from airflow_nats_ordered.core.publish.runs import RunLedger, RunRecord
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

T = TypeVar("T")


def on_server(url: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    async def go() -> T:
        nc = await nats.connect(url)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(go())


def make_stream(url: str, name: str, partitions: int = 4) -> None:
    on_server(url, lambda nc: provision(nc, StreamSpec(name, partitions=partitions)))


def stored(url: str, name: str) -> list[Stored]:
    return on_server(url, lambda nc: read_stream(nc, name))


def run_record(url: str, stream: str, producer_id: str) -> RunRecord | None:
    async def get(nc: Any) -> RunRecord | None:
        return await (await RunLedger.open(nc, stream)).get(producer_id)

    return on_server(url, get)


#: the duplicate_window of the Spark resume tests' streams: deliveryTimeout 1 s + the
#: publisher's ack_timeout 5 s (the longest resend, the shortest window the sink accepts) + 1 s
WINDOW = 7.0


def wait_past_the_window(url: str, stream: str, window: float = WINDOW) -> None:
    """Until the stream's newest message is older than its duplicate window: a resend of any
    stored msg-id is then stored again (what makes a resume's mistakes visible)."""

    async def newest(nc: Any) -> dt.datetime:
        js = nc.jetstream()
        last = (await js.stream_info(stream)).state.last_seq
        return (await js.get_msg(stream, last)).time

    limit = on_server(url, newest) + dt.timedelta(seconds=window + 1)
    deadline = time.monotonic() + 60
    while dt.datetime.now(dt.UTC) < limit:
        assert time.monotonic() < deadline, "the clock does not move"
        time.sleep(0.2)


def partition_of(s: Stored) -> int:
    return int(s.subject.rsplit(".", 1)[1])


def exactly_once_in_order(
    rows: list[dict[str, Any]], got: list[Stored], key: str, order: str
) -> list[str]:
    """Every input row stored exactly once (by content and by msg-id), each key's rows in
    ``order`` order, each key on one partition: the problems found, named."""
    problems: list[str] = []
    ids = [s.msg_id for s in got]
    if len(set(ids)) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} msg-ids are stored twice")
    want = sorted(json.dumps(r, sort_keys=True) for r in rows)
    have = sorted(json.dumps(json.loads(s.data), sort_keys=True) for s in got)
    if want != have:
        missing = len(set(want) - set(have))
        problems.append(
            f"stored rows differ from the input: {len(have)} stored, {len(want)} input, "
            f"{missing} input rows missing, {len(have) - len(set(have))} stored twice"
        )
    per_key: dict[str, list[Any]] = defaultdict(list)
    parts: dict[str, set[int]] = defaultdict(set)
    for s in got:
        row = json.loads(s.data)
        if s.key != row[key]:
            problems.append(f"seq {s.seq}: header key {s.key!r} but row key {row[key]!r}")
        per_key[row[key]].append(row[order])
        parts[row[key]].add(partition_of(s))
    for k, values in per_key.items():
        if values != sorted(values):
            problems.append(f"key {k}: stored out of {order} order: {values[:10]}")
        if len(parts[k]) != 1:
            problems.append(f"key {k} is on partitions {sorted(parts[k])}")
    return problems[:10]
