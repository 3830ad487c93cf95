"""A ``nats://`` watcher whose stream does not exist yet waits for it (issue 30 defect 3).

``dead_letter_triage`` unpaused before ``<STREAM>_DLQ`` existed: the watcher raised "stream
does not exist", the triggerer restarted it every ~2 s with the error each time. Now it
logs one WARNING (the stream, what creates it), checks again with backoff (1 s doubling
to 30 s) on the triggerer's event loop, logs one line when the stream appears and reads it;
the same for NATS servers that cannot be reached. A bad configuration still fails at once.
Real nats-servers, Airflow's own shared-stream manager and a real ``airflow triggerer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from watcher_deployment import WatcherDeployment, wait_for

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec
from airflow_nats_ordered.core.worker.dead_letters import dead_letter_subject
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.triggers import messages
from airflow_nats_ordered.triggers.messages import (
    NatsMessageProducer,
    NatsMessageTrigger,
    dead_letter_trigger,
)

WAITING = "does not exist yet"
APPEARED = "after waiting"


class Records(logging.Handler):
    """The trigger module's log records (its logger, whatever Airflow did to the root)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def count(self, text: str) -> int:
        return sum(text in r.getMessage() for r in self.records)

    def text(self) -> str:
        return "\n".join(f"{r.levelname} {r.getMessage()}" for r in self.records)


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger(messages.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _conn(monkeypatch: pytest.MonkeyPatch, conn_id: str, url: str) -> str:
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "nats", "host": url})
    )
    return conn_id


async def _until(what: str, ok: Any, task: asyncio.Task | None = None, timeout: float = 30) -> None:
    """Wait for ``ok()``; fail naming ``what``, or how ``task`` ended if it ended first."""
    async with asyncio.timeout(timeout):
        while not ok():
            if task is not None and task.done():
                raise AssertionError(f"gave up before {what}: the producer ended with {task!r}")
            await asyncio.sleep(0.05)


async def _dead_letter_stream(url: str, stream: str, group: str, n: int) -> None:
    """Create ``<stream>_DLQ`` as a worker does and publish ``n`` dead letters of ``group``."""
    prefix = StreamSpec(name=stream).prefix
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=f"{stream}_DLQ", subjects=[f"{prefix}.dlq.>"])
        for i in range(n):
            await js.publish(dead_letter_subject(prefix, group, i), b"poison")
    finally:
        await nc.close()


def test_a_dead_letter_watcher_waits_for_its_stream_then_reads_it(
    monkeypatch, nats_url, unique_name, records
) -> None:
    """The producer of ``dead_letter_trigger`` on a stream without ``<STREAM>_DLQ``: it
    waits (one WARNING naming the stream and what creates it), then reads the first dead
    letter once a worker created the stream and set it aside (one INFO line)."""
    conn_id = _conn(monkeypatch, "nats_waits_dlq", nats_url)
    trigger = dead_letter_trigger(unique_name, "billing", nats_conn_id=conn_id)
    producer = NatsMessageTrigger.create_shared_stream_producer(trigger.serialize()[1])

    async def main() -> dict[str, Any]:
        stream = producer.open_stream()
        first = asyncio.ensure_future(anext(stream))
        try:
            await _until("the waiting message", lambda: records.count(WAITING) >= 1, first)
            # a few re-checks (1, 2, 4 s apart) pass without a second message or an error
            await asyncio.sleep(4)
            assert not first.done(), first
            await _dead_letter_stream(nats_url, unique_name, "billing", 1)
            async with asyncio.timeout(60):
                delivery, _ = await first
            return dict(delivery)
        finally:
            first.cancel()
            await producer.aclose()

    delivery = asyncio.run(main())
    print(f"\nwaited, then read: {records.text()}")
    assert delivery["stream"] == f"{unique_name}_DLQ"
    assert delivery["stream_seq"] == 1
    assert records.count(WAITING) == 1, records.text()
    (waiting,) = [r for r in records.records if WAITING in r.getMessage()]
    assert waiting.levelno == logging.WARNING
    text = waiting.getMessage()
    assert f"stream '{unique_name}_DLQ' does not exist yet" in text
    assert f"dead-letter stream of '{unique_name}'" in text and "poison policy dead-letter" in text
    assert records.count(APPEARED) == 1, records.text()


def test_cancelling_a_waiting_watcher_ends_it_at_once(monkeypatch, nats_url, unique_name, records):
    """The wait is a sleep on the triggerer's loop: removing the trigger (Airflow's
    shared-stream manager cancels the poll, then closes the producer) ends it at once,
    with no retry after it."""
    conn_id = _conn(monkeypatch, "nats_waits_cancel", nats_url)
    trigger = NatsMessageTrigger(stream=unique_name, nats_conn_id=conn_id)

    async def main() -> bool:
        manager = SharedStreamManager(ack_timeout=60)
        key = trigger.shared_stream_key()
        shared = manager.subscribe(trigger_id=1, trigger=trigger, key=key)
        group = manager._groups[key]
        await _until("the waiting message", lambda: records.count(WAITING) >= 1, group._poll_task)
        async with asyncio.timeout(20):
            await manager.unsubscribe(1, key)  # run_trigger's finally: the group stops
        await shared.aclose()
        return group._poll_task.done()

    assert asyncio.run(main())
    assert records.count(WAITING) == 1
    assert "fix stream= if the name is wrong" in records.text()
    assert records.count(APPEARED) == 0


def test_a_watcher_waits_for_unreachable_servers(monkeypatch, tmp_path, unique_name, records):
    """The servers down when the trigger starts: one WARNING, then it reads once they are
    back (transient, like a missing stream)."""
    with NatsServer(tmp_path / "nats", name="waits") as server:
        conn_id = _conn(monkeypatch, "nats_waits_down", server.url)
        trigger = NatsMessageTrigger(stream=unique_name, nats_conn_id=conn_id)
        producer = NatsMessageTrigger.create_shared_stream_producer(trigger.serialize()[1])
        server.stop()

        async def main() -> int:
            stream = producer.open_stream()
            first = asyncio.ensure_future(anext(stream))
            try:
                await _until(
                    "the waiting message", lambda: "cannot reach NATS" in records.text(), first
                )
                await asyncio.to_thread(server.start)
                nc = await nats.connect(server.url)
                js = nc.jetstream()
                await js.add_stream(name=unique_name, subjects=[f"{unique_name}.>"])
                await js.publish(f"{unique_name}.m", b"x")
                await nc.close()
                async with asyncio.timeout(90):
                    delivery, _ = await first
                return int(delivery["stream_seq"])
            finally:
                first.cancel()
                await producer.aclose()

        assert asyncio.run(main()) == 1
    assert records.text().count("cannot reach NATS") == 1, records.text()
    assert records.count(APPEARED) == 1


def test_a_filter_outside_the_stream_fails_at_once(monkeypatch, nats_url, unique_name, records):
    """A bad configuration is not waited for: the trigger fails with what to fix. (Before,
    nats-server accepted the consumer and the watcher read nothing, silently.)"""
    conn_id = _conn(monkeypatch, "nats_waits_filter", nats_url)
    trigger = NatsMessageTrigger(stream=unique_name, subject="elsewhere.>", nats_conn_id=conn_id)
    producer = NatsMessageTrigger.create_shared_stream_producer(trigger.serialize()[1])
    assert isinstance(producer, NatsMessageProducer)

    async def main() -> None:
        nc = await nats.connect(nats_url)
        await nc.jetstream().add_stream(name=unique_name, subjects=[f"{unique_name}.>"])
        await nc.close()
        try:
            async with asyncio.timeout(30):
                await anext(producer.open_stream())
        finally:
            await producer.aclose()

    with pytest.raises(ConfigError) as e:
        asyncio.run(main())
    assert (
        f"subject='elsewhere.>' matches none of the subjects of stream '{unique_name}' "
        f"({unique_name}.>)" in str(e.value)
    )
    assert "fix subject=" in str(e.value)
    assert records.count(WAITING) == 0


# --- a real triggerer -----------------------------------------------------------------

FAILED = re.compile(r"Shared stream poll failed|Trigger .*failed|Traceback")


@pytest.mark.slow  # real triggerers for a minute: make test-slow, one at a time
def test_a_real_triggerer_waits_for_the_stream_without_restarting_the_watcher(
    nats_url, unique_name, tmp_path: Path
) -> None:
    """A watcher DAG registered before its stream (``<NAME>_DLQ``, as ``dead_letter_triage``
    before the first dead letter): over 15 s the triggerer logs one waiting message and no
    failure or restart; then the stream is created, 3 messages are published, each
    becomes an asset event and is acked."""
    dep = WatcherDeployment(tmp_path, nats_url, f"{unique_name}_DLQ", create_stream=False)
    t = dep.triggerer("1")
    try:

        def started() -> bool:
            log = t.log()
            return WAITING in log or len(FAILED.findall(log)) >= 3

        wait_for("the triggerer to run the watcher", started, timeout=120)
        time.sleep(15)  # the old watcher failed and restarted every ~2 s
        log = t.log()
        failures = FAILED.findall(log)
        assert not failures, (
            f"the watcher failed {len(failures)} times in ~15 s instead of waiting:\n" + log[-3000:]
        )
        assert log.count(WAITING) == 1, log[-3000:]
        dep.make_stream()
        dep.publish(3)
        wait_for("3 asset events stored and acked", dep.caught_up, timeout=90)
        log = t.log()
    finally:
        t.stop()
    print("\n" + "\n".join(line for line in log.splitlines() if "NatsMessageTrigger" in line))
    assert sorted(dep.stored()) == [1, 2, 3]
    assert log.count(WAITING) == 1 and log.count(APPEARED) == 1, log[-3000:]
    assert not FAILED.findall(log), log[-3000:]
