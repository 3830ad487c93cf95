"""Drain waits across a repartition (issue 18 part 2): a wait that spans the group's switch
from the old layout to the new one returns only once the old and the new records are all
applied; ``status`` shows the layout the group is at and counts the new one in the lag."""

from __future__ import annotations

import asyncio
import json
import threading

import nats

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.drain import read_lag, wait_drained
from airflow_nats_ordered.core.publisher import OrderedPublisher
from airflow_nats_ordered.core.repartition import repartition
from airflow_nats_ordered.core.streams import StreamSpec, provision
from airflow_nats_ordered.core.worker import Worker, WorkerConfig

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
