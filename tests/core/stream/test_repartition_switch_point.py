"""The recorded switch point is exact under a concurrent publisher (issue 28 item 4): every
record of the closed layout has a sequence at or below it, every record of the new layout
one above it. Publishes to the old subjects that the server took before the switching
update may still be queued for the stream when the update is answered; the switch point
is read only once they are stored."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nats
import pytest

from airflow_nats_ordered.core.stream.partitioned import (
    StreamSpec,
    describe,
    provision,
    stream_contents,
)
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.embedded.servers import NatsCluster, NatsServer

#: a publisher process publishing as fast as it can until the stop file appears: rounds of
#: 2000 publishes in flight at once, each to its key's partition in the layout read at the
#: round's start; what the server refused (a switch came) goes again on the new layout, with
#: the same msg-id. (Plain JetStream publishes: the test is about the server's side.)
PUBLISHER = textwrap.dedent(
    """
    import asyncio, os, sys
    import nats
    from airflow_nats_ordered.core.stream.partitioning import partition_for
    from airflow_nats_ordered.core.stream.partitioned import describe

    url, stream, stop = sys.argv[1], sys.argv[2], sys.argv[3]

    async def main():
        nc = await nats.connect(servers=url.split(","))
        js = nc.jetstream(timeout=10)
        i = 0
        while not os.path.exists(stop):
            todo = list(range(i, i + 2000))
            while todo:
                s = await describe(nc, stream)
                sent = [
                    js.publish(
                        s.subject(partition_for(f"k{j % 64}", s.partitions)),
                        b"x" * 256,
                        headers={"Nats-Msg-Id": f"m{j}", "Nats-Ordered-Key": f"k{j % 64}"},
                    )
                    for j in todo
                ]
                acks = await asyncio.gather(*sent, return_exceptions=True)
                todo = [j for j, a in zip(todo, acks) if isinstance(a, BaseException)]
            i += 2000
        await nc.close()

    asyncio.run(main())
    """
)


def _wait(cond, what: str, pub: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if pub.poll() is not None:
            err = pub.stderr.read().decode()[-3000:] if pub.stderr else ""
            raise AssertionError(f"{what}: the publisher exited ({pub.returncode}): {err}")
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g}s"
        time.sleep(0.05)


@pytest.mark.parametrize("where", ["server", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_every_old_layout_record_is_at_or_below_the_recorded_switch_point(
    unique_name, tmp_path: Path, where
):
    """On one server and on a 3-node cluster (a stream of 3 replicas), each fsyncing every
    write (``sync_interval: always``): the stream stores slower than the publisher sends,
    so publishes to the old subjects are still queued when the switching update is
    answered (the earlier version recorded the last sequence read right then: on one
    server, switch points 1782 and 7517 below old-layout records up to 2000 and 8000)."""
    stream = unique_name
    stop = tmp_path / "stop"
    counts = [4, 8, 3, 6]  # three switches, each under the publisher
    with contextlib.ExitStack() as stack:
        if where == "cluster":
            cluster = stack.enter_context(NatsCluster(tmp_path / "cluster", sync_always=True))
            url, replicas = ",".join(cluster.urls), 3
        else:
            server = stack.enter_context(
                NatsServer(tmp_path / "nats", name="switch-point", sync_always=True)
            )
            url, replicas = server.url, 1
        _switch_under_a_publisher(url, stream, stop, counts, replicas)


def _switch_under_a_publisher(
    url: str, stream: str, stop: Path, counts: list[int], replicas: int
) -> None:
    async def setup() -> None:
        nc = await nats.connect(servers=url.split(","))
        await provision(nc, StreamSpec(stream, partitions=counts[0], replicas=replicas))
        await nc.close()

    asyncio.run(setup())
    pub = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, url, stream, str(stop)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    async def last_seq() -> int:
        nc = await nats.connect(servers=url.split(","))
        info = await nc.jetstream().stream_info(stream)
        await nc.close()
        return int(info.state.last_seq or 0)

    switches = []
    try:
        for n in counts[1:]:
            floor = asyncio.run(last_seq()) + 3000
            # the publisher is in full flow: records in flight at the switch
            _wait(lambda f=floor: asyncio.run(last_seq()) >= f, "the publisher publishes", pub)

            async def switch(n: int = n) -> int:
                nc = await nats.connect(servers=url.split(","))
                result = await repartition(nc, stream, n)
                await nc.close()
                return result.switch_seq

            switches.append(asyncio.run(switch()))
        floor = asyncio.run(last_seq()) + 3000
        _wait(lambda: asyncio.run(last_seq()) >= floor, "the publisher publishes after", pub)
    finally:
        stop.touch()
        try:
            pub.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(pub.pid, signal.SIGKILL)
            pub.wait(timeout=60)
    assert pub.returncode == 0, pub.stderr.read().decode() if pub.stderr else ""

    async def check() -> list[tuple[int, int, int, int]]:
        nc = await nats.connect(servers=url.split(","))
        s = await describe(nc, stream)
        assert [lay.switch_seq for lay in s.layouts] == switches
        rows = []
        for lay in (*s.layouts, s.layout):
            stats = (await stream_contents(nc, s.at_epoch(lay.epoch))).partitions
            js = nc.jetstream()
            firsts = [
                int((await js.get_msg(stream, seq=1, subject=st.subject, next=True)).seq)
                for st in stats
                if st.messages
            ]
            rows.append(
                (
                    lay.epoch,
                    max(st.last_seq for st in stats),
                    min(firsts),
                    lay.switch_seq,
                )
            )
        await nc.close()
        return rows

    rows = asyncio.run(check())
    print("epoch, last old-layout seq, first seq, recorded switch point:", rows)
    previous_switch = 0
    for epoch, last, first, switch in rows:
        assert first > previous_switch, (
            f"epoch {epoch} has a record at seq {first}, at or below the switch point "
            f"{previous_switch} of the layout before it: {rows}"
        )
        if epoch < rows[-1][0]:
            assert last <= switch, (
                f"epoch {epoch}'s subjects hold records up to seq {last}, above its recorded "
                f"switch point {switch}: {rows}"
            )
            assert last == switch  # exact: the sequence of the layout's last record
        previous_switch = switch
