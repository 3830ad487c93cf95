"""Drain waits across a repartition (issue 18 part 2): a wait that spans the group's switch
from the old layout to the new one returns only once the old and the new records are all
applied; ``status`` shows the layout the group is at and counts the new one in the lag."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import nats

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.admin.listing import GroupRef, summarize_group
from airflow_nats_ordered.core.group.lag import group_lag
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision, stream_contents
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

KEYS = 8


async def _publish(nc, stream, rounds):
    async with OrderedPublisher(nc, stream) as pub:
        for r in rounds:
            for k in range(KEYS):
                await pub.publish(f"k{k}", json.dumps({"i": r}).encode(), msg_id=f"k{k}-{r}")


def test_a_drain_wait_spanning_the_switch_returns_only_when_old_and_new_are_applied(
    shared_nats_server, unique_name, capsys
):
    url, stream = shared_nats_server.url, unique_name
    applied: list[tuple[str, int]] = []
    cli_result: dict[str, int] = {}

    async def handler(msg):
        await asyncio.sleep(0.005)
        applied.append((msg.key, json.loads(msg.data)["i"]))

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        w = Worker(nc, WorkerConfig(stream, "g", member_id="w1", lease_ttl=2.0), handler)
        await w.start()  # the group exists at epoch 0, processing nothing yet
        await w.wait_assigned(60)
        await w.stop()
        await _publish(nc, stream, range(0, 10))  # old layout
        await repartition(nc, stream, 8)
        await _publish(nc, stream, range(10, 20))  # new layout
        lag = await read_lag(nc, stream, "g")
        assert (lag.epoch, lag.stream_epoch, lag.later) == (0, 1, 10 * KEYS)
        assert not lag.drained and lag.total_lag == 20 * KEYS
        # the group is still at the old layout: the waits start before it switches
        core_wait = asyncio.ensure_future(
            wait_drained(nc, stream, "g", timeout=120, no_members_timeout=None)
        )
        args = ["status", "--stream", stream, "--group", "g", "--wait-drained"]
        args += ["--timeout", "120s", "--no-members-timeout", "0", "--server", url]
        t = threading.Thread(target=lambda: cli_result.update(code=cli.main(args)))
        t.start()
        await asyncio.sleep(0.5)
        assert not core_wait.done()
        workers = [
            Worker(nc, WorkerConfig(stream, "g", member_id=m, lease_ttl=2.0), handler)
            for m in ("w1", "w2")
        ]
        for w in workers:
            await w.start()
        progress = await core_wait
        # returned drained: every record of both layouts was applied by then
        assert progress.done and progress.waiting_epoch is None
        assert len(set(applied)) == 20 * KEYS
        await asyncio.to_thread(t.join, 120)
        assert cli_result["code"] == 0
        assert len(set(applied)) == 20 * KEYS
        lag = await read_lag(nc, stream, "g")
        assert (lag.epoch, lag.later, lag.drained) == (1, 0, True)
        for w in workers:
            await w.stop()
        await nc.close()

    asyncio.run(main())
    out = capsys.readouterr().out
    assert "drained" in out


def test_a_group_still_on_the_old_layout_is_never_drained_whatever_reads_its_lag(
    shared_nats_server, unique_name
):
    """Right after a repartition the new layout is empty: a lag computed from the stream's
    current partitions (metrics, group list) must not count the old layout's commits for
    them, and the group is not drained until it has finished the old layout."""
    url, stream = shared_nats_server.url, unique_name

    async def main():
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        w = Worker(nc, WorkerConfig(stream, "g", member_id="w1", lease_ttl=2.0), _noop)
        await w.start()
        await w.wait_assigned(60)
        await w.stop()
        await _publish(nc, stream, range(0, 5))
        await repartition(nc, stream, 8)  # nothing published on the new layout
        store = await GroupStore.attach(nc, stream, "g")
        snap = await store.snapshot()
        assert (snap.epoch, snap.stream_epoch) == (0, 1)
        current = await stream_contents(nc, stream)
        assert not group_lag(stream, "g", current.partitions, snap).drained
        lag = await read_lag(nc, stream, "g")
        assert (lag.epoch, lag.later, lag.drained, lag.total_lag) == (0, 0, False, 5 * KEYS)
        listed = await summarize_group(nc, GroupRef(stream, "g"))
        assert not listed.drained and listed.total_lag == 5 * KEYS
        w = Worker(nc, WorkerConfig(stream, "g", member_id="w1", lease_ttl=2.0), _noop)
        await w.start()

        async def moved():  # finished the old layout, and switched to the new one
            lag = await read_lag(nc, stream, "g")
            return lag.drained and lag.epoch == 1

        deadline = time.monotonic() + 60
        while not await moved():
            assert time.monotonic() < deadline, "the group did not finish the old layout"
            await asyncio.sleep(0.2)
        snap = await (await GroupStore.attach(nc, stream, "g")).snapshot()
        current = await stream_contents(nc, stream)
        assert group_lag(stream, "g", current.partitions, snap).drained
        await w.stop()
        await nc.close()

    asyncio.run(main())


def _noop(msg):
    pass
