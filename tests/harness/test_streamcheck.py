"""The tests' own stream reader (``streamcheck.read_stream``) reads everything once even when
its consumer disappears mid-read, as an ephemeral consumer does past its inactive threshold
on a loaded machine (a loaded CI run failed a Spark test with ServiceUnavailableError from
the reader, not from the code under test)."""

from __future__ import annotations

import asyncio

import nats
from streamcheck import read_stream

N = 1500


def test_read_stream_survives_its_consumer_being_deleted_mid_read(shared_nats_server, unique_name):
    async def go() -> tuple[list[int], int]:
        nc = await nats.connect(shared_nats_server.url)
        js = nc.jetstream()
        try:
            await js.add_stream(name=unique_name, subjects=[f"{unique_name}.>"])
            for i in range(N):
                await js.publish(f"{unique_name}.{i % 5}", str(i).encode())
            stop = asyncio.Event()
            deleted = 0

            async def delete_consumers() -> None:
                nonlocal deleted
                while not stop.is_set():
                    for c in await js.consumers_info(unique_name):
                        try:
                            await js.delete_consumer(unique_name, c.name)
                            deleted += 1
                        except nats.js.errors.NotFoundError:
                            pass
                    await asyncio.sleep(0.005)

            killer = asyncio.create_task(delete_consumers())
            try:
                out = await read_stream(nc, unique_name, batch=50)
            finally:
                stop.set()
                await killer
            return [s.seq for s in out], deleted
        finally:
            await nc.close()

    seqs, deleted = asyncio.run(go())
    assert deleted > 0, "no consumer was deleted during the read: the test proved nothing"
    assert seqs == list(range(1, N + 1))
