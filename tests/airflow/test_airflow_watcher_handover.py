"""A ``nats://`` watcher acks a message only after Airflow stored its asset event, also when
the trigger stops in the middle of handing the event over (issue 28 item 8).

Airflow 3.3's triggerer takes an event from the trigger's filter, logs "Trigger fired
event" (an ``await``), then binds the event to its persistence gate and queues it for the
database. Airflow reports a message clean, and our producer would ack it, in two cases
where the event was never stored:

* the trigger task is cancelled or fails during that ``await`` (its triggerer stopping,
  the trigger moving to another triggerer): ``run_trigger``'s ``finally`` unsubscribes,
  and leaving resolves the event the subscriber sits on as accepted, with nothing bound
  to confirm;
* the shared stream was stopped (``stop_all`` at triggerer shutdown) while the trigger
  still takes queued events: the bind finds no group and the event is queued with
  nothing to confirm, so moving past it resolves it as accepted.

These tests drive Airflow's own ``SharedStreamManager`` exactly as ``run_trigger`` does
(subscribe, take the event, bind, unsubscribe / stop) against a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nats
import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_nats_ordered.triggers.messages import NatsMessageProducer, NatsMessageTrigger

ACK_WAIT = 1.0


@pytest.fixture
def nats_conn(monkeypatch: pytest.MonkeyPatch, nats_url: str) -> str:
    monkeypatch.setenv(
        "AIRFLOW_CONN_NATS_HANDOVER_TEST", json.dumps({"conn_type": "nats", "host": nats_url})
    )
    return "nats_handover_test"


async def _stream(url: str, name: str, n: int) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        for i in range(n):
            await js.publish(f"{name}.m", str(i).encode())
    finally:
        await nc.close()


async def _ack_floor(url: str, stream: str, consumer: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().consumer_info(stream, consumer)).ack_floor.stream_seq
    finally:
        await nc.close()


async def _next_reader_gets(trigger: NatsMessageTrigger, quiet: float = 3 * ACK_WAIT) -> list[int]:
    """The stream sequences a new reader of the trigger's consumer receives (until
    nothing comes for ``quiet`` seconds): what was not acked. (A message nak'ed while
    the stopped reader's pull request was still open comes back ``ack_wait`` later.)"""
    producer = NatsMessageTrigger.create_shared_stream_producer(trigger.serialize()[1])
    assert isinstance(producer, NatsMessageProducer)
    stream = producer.open_stream()
    got = []
    try:
        async with asyncio.timeout(30):
            while True:
                try:
                    async with asyncio.timeout(quiet):
                        delivery, _ = await anext(stream)
                except TimeoutError:
                    return sorted(got)
                got.append(delivery["stream_seq"])
    finally:
        await producer.aclose()


def _watch(nats_conn: str, stream: str) -> tuple[NatsMessageTrigger, SharedStreamManager, Any]:
    """A trigger subscribed to its shared stream in ack mode, as the triggerer does it."""
    trigger = NatsMessageTrigger(stream=stream, nats_conn_id=nats_conn, ack_wait=ACK_WAIT)
    manager = SharedStreamManager(ack_timeout=60)
    shared = manager.subscribe(trigger_id=1, trigger=trigger, key=trigger.shared_stream_key())
    return trigger, manager, trigger.filter_shared_stream(shared)


def test_an_event_whose_trigger_stopped_before_the_triggerer_queued_it_is_not_acked(
    nats_url, nats_conn, unique_name
) -> None:
    """The trigger task is cancelled right after the filter yielded message 2's event,
    while the triggerer logs "Trigger fired event" (before it binds and queues it):
    message 2 is not acked, the next reader of the consumer gets it again."""

    async def main() -> tuple[int, list[int]]:
        await _stream(nats_url, unique_name, 2)
        trigger, manager, events = _watch(nats_conn, unique_name)
        key = trigger.shared_stream_key()
        await anext(events)  # message 1's event: bound and queued
        stored = manager.bind_pending_event(trigger_id=1, key=key)
        await anext(events)  # message 2's event, taken; the task is cancelled right here
        manager.confirm_persisted([stored])  # message 1's event is stored meanwhile
        await manager.unsubscribe(1, key)  # run_trigger's finally
        await events.aclose()  # the abandoned filter, finalized
        return (
            await _ack_floor(nats_url, unique_name, trigger.consumer_name),
            await _next_reader_gets(trigger),
        )

    ack_floor, again = asyncio.run(main())
    print(f"\ncancelled mid-hand-over: ack floor {ack_floor}, the next reader gets {again}")
    assert again == [2], "message 2 was acked though its event was never stored"
    assert ack_floor == 1


def test_an_event_taken_after_the_shared_stream_stopped_is_not_acked(
    nats_url, nats_conn, unique_name
) -> None:
    """At triggerer shutdown the runner stops the shared streams (``stop_all``) while its
    trigger tasks still run: the trigger takes the message already queued for it, the
    bind finds no group (nothing will confirm it, and the runner stores nothing more),
    the trigger moves on. The message is not acked: the next reader gets it again."""

    async def main() -> tuple[int, list[int]]:
        await _stream(nats_url, unique_name, 1)
        trigger, manager, events = _watch(nats_conn, unique_name)
        key = trigger.shared_stream_key()
        group = manager._groups[key]
        async with asyncio.timeout(20):  # the poll fetched message 1 and queued it
            while not group._outstanding:
                await asyncio.sleep(0.01)
        stopping = asyncio.create_task(manager.stop_all())
        await asyncio.sleep(0)  # the group has left the manager and is stopping
        await anext(events)  # the trigger task takes message 1's event
        assert manager.bind_pending_event(trigger_id=1, key=key) is None
        moving_on = asyncio.create_task(anext(events))  # past message 1: "accepted"
        await stopping
        moving_on.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await moving_on
        return (
            await _ack_floor(nats_url, unique_name, trigger.consumer_name),
            await _next_reader_gets(trigger),
        )

    ack_floor, again = asyncio.run(main())
    print(f"\ntaken after stop: ack floor {ack_floor}, the next reader gets {again}")
    assert again == [1], "message 1 was acked though its event was never stored"
    assert ack_floor == 0
