"""Event-driven scheduling from NATS (``nats://``): NatsMessageTrigger, its ack-mode producer
and the ``nats`` MessageQueueTrigger scheme, against real nats-servers and real Airflow.

The guarantee under test: every message becomes at least one asset event, and a message is
acknowledged to JetStream only after Airflow stored its event; duplicates only after a
failure. The triggerer test (``test_no_message_lost_when_the_triggerer_is_killed_mid_stream``)
kills a real ``airflow triggerer`` process while events flow.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome, SharedStreamManager
from airflow_processes import Triggerer, airflow, private_home, query
from locations import ROOT

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.triggers.messages import (
    CLASSPATH,
    NatsMessageProducer,
    NatsMessageTrigger,
    dead_letter_trigger,
)

CLEAN = AdvanceOutcome(acked=1, failed=0)
FAILED = AdvanceOutcome(acked=0, failed=1)
REJECTED = AdvanceOutcome(acked=0, failed=0, rejected=1)


@pytest.fixture
def nats_conn(monkeypatch: pytest.MonkeyPatch, nats_url: str) -> str:
    """An Airflow connection ``nats_queue_test`` (JSON env var) to the shared server."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_NATS_QUEUE_TEST", json.dumps({"conn_type": "nats", "host": nats_url})
    )
    return "nats_queue_test"


async def _stream(url: str, name: str, n: int = 0, **publish: Any) -> None:
    """Create stream ``name`` (subjects ``<name>.>``) and publish ``n`` messages to it."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        for i in range(n):
            await js.publish(f"{name}.m", f"msg-{i}".encode(), **publish)
    finally:
        await nc.close()


async def _take(stream: AsyncIterator[tuple[dict, Any]], n: int) -> list[tuple[dict, Any]]:
    out = []
    async with asyncio.timeout(20):
        while len(out) < n:
            out.append(await anext(stream))
    return out


async def _nothing_more(stream: AsyncIterator[Any], seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            await anext(stream)
    except TimeoutError:
        return True
    return False


def _producer(conn_id: str, stream: str, **kw: Any) -> NatsMessageProducer:
    kwargs = NatsMessageTrigger(
        stream=stream, durable="d1", nats_conn_id=conn_id, **kw
    ).serialize()[1]
    return NatsMessageTrigger.create_shared_stream_producer(kwargs)


async def _vanish(producer: NatsMessageProducer) -> None:
    """What a SIGKILL leaves behind: no nak, no in-progress acks, the connection gone."""
    producer._keepalive.cancel()
    await producer._stack.aclose()


# --- the trigger's interface -----------------------------------------------------------


def test_trigger_serializes_json_safe_kwargs_that_rebuild_the_same_trigger() -> None:
    t = NatsMessageTrigger(
        stream="ORDERS", durable="airflow-orders", subject="orders.p.*", ack_wait=7, batch=10
    )
    classpath, kwargs = t.serialize()
    assert classpath == CLASSPATH == f"{type(t).__module__}.{type(t).__name__}"
    again = NatsMessageTrigger(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (classpath, kwargs)
    assert kwargs["nats_conn_id"] == "nats_default" and kwargs["deliver_policy"] == "all"
    # triggers reading the same consumer share one poll; another durable does not
    assert again.shared_stream_key() == t.shared_stream_key()
    other = NatsMessageTrigger(stream="ORDERS", durable="other", subject="orders.p.*")
    assert other.shared_stream_key() != t.shared_stream_key()


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"stream": "S", "durable": ""}, "durable"),
        ({"stream": "S", "durable": "a.b"}, "durable"),
        ({"stream": "a b", "durable": "d"}, "stream"),
        ({"stream": "S", "durable": "d", "deliver_policy": "first"}, "deliver_policy"),
        ({"stream": "S", "durable": "d", "ack_wait": 0}, "ack_wait"),
    ],
)
def test_bad_trigger_arguments_are_refused_naming_the_parameter(kwargs, fix) -> None:
    with pytest.raises(ConfigError, match=fix):
        NatsMessageTrigger(**kwargs)


def test_message_queue_trigger_with_scheme_nats_resolves_to_the_nats_trigger() -> None:
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk import Asset, AssetWatcher

    assert "airflow_nats_ordered.queues.nats.NatsMessageQueueProvider" in (
        ProvidersManager().queue_class_names
    )
    mq = MessageQueueTrigger(scheme="nats", stream="ORDERS", subject="orders.>", durable="d")
    assert isinstance(mq.trigger, NatsMessageTrigger)
    classpath, kwargs = mq.serialize()  # what the triggerer stores and runs
    assert classpath == CLASSPATH
    assert (kwargs["stream"], kwargs["subject"], kwargs["durable"]) == ("ORDERS", "orders.>", "d")
    Asset("orders", watchers=[AssetWatcher(name="orders", trigger=mq)])


def test_run_outside_the_shared_stream_refuses_rather_than_acking_before_persistence() -> None:
    async def main() -> None:
        await anext(NatsMessageTrigger(stream="S", durable="d").run())

    with pytest.raises(RuntimeError, match="AssetWatcher"):
        asyncio.run(main())


def test_dead_letter_trigger_watches_the_groups_dead_letter_subject() -> None:
    from airflow_nats_ordered.core.worker.dead_letters import dead_letter_subject

    t = dead_letter_trigger("ORDERS", "billing", ack_wait=5)
    assert (t.stream, t.durable, t.ack_wait) == ("ORDERS_DLQ", "airflow-dlq-billing", 5)
    assert t.subject == "orders.dlq.billing.*"
    assert nats_subject_matches(t.subject, dead_letter_subject("orders", "billing", 11))
    t = dead_letter_trigger("ORDERS", "billing", subject_prefix="shop.orders", durable="x")
    assert (t.subject, t.durable) == ("shop.orders.dlq.billing.*", "x")


def nats_subject_matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True))


# --- the producer against a real server -------------------------------------------------


def test_payload_is_json_safe_with_text_or_base64_data_headers_and_sequence(
    nats_url, nats_conn, unique_name
) -> None:
    async def main() -> list[dict]:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.add_stream(name=unique_name, subjects=[f"{unique_name}.>"])
        await js.publish(f"{unique_name}.a", "héllo".encode(), headers={"Nats-Msg-Id": "m-1"})
        await js.publish(f"{unique_name}.b", b"\xff\x00binary", headers={"k": "v"})
        await nc.close()
        producer = _producer(nats_conn, unique_name)
        try:
            got = await _take(producer.open_stream(), 2)
        finally:
            await producer.aclose()
        return [json.loads(json.dumps(payload)) for payload, _ in got]

    text, binary = asyncio.run(main())
    assert text["subject"] == f"{unique_name}.a" and text["stream"] == unique_name
    assert (text["data"], text["data_encoding"], text["msg_id"]) == ("héllo", "utf-8", "m-1")
    assert (text["stream_seq"], text["redeliveries"], text["consumer"]) == (1, 0, "d1")
    assert binary["data_encoding"] == "base64" and binary["msg_id"] is None
    assert base64.b64decode(binary["data"]) == b"\xff\x00binary"
    assert binary["headers"] == {"k": "v"} and binary["stream_seq"] == 2


def test_advance_acks_only_clean_items_terms_rejected_and_redelivers_the_rest(
    nats_url, nats_conn, unique_name
) -> None:
    async def main() -> tuple[list[int], list[int]]:
        await _stream(nats_url, unique_name, 6)
        first = _producer(nats_conn, unique_name)
        try:
            got = await _take(first.open_stream(), 6)
            for delivery, _ in got[:2]:  # the filter handed their events to the gate
                delivery.handed_over()
            msgs = [m for _, m in got]
            await first.advance(
                [
                    AdvanceItem(msgs[0], CLEAN),
                    AdvanceItem(msgs[1], CLEAN),
                    AdvanceItem(msgs[2], FAILED),  # persist failed / ack timeout
                    AdvanceItem(msgs[3], REJECTED),  # a subscriber refused it
                    AdvanceItem(msgs[4], AdvanceOutcome(acked=0, failed=0)),  # nobody online
                ]
            )  # msgs[5]: never advanced; aclose() hands it back
        finally:
            await first.aclose()
        second = _producer(nats_conn, unique_name)
        try:
            stream = second.open_stream()
            again = await _take(stream, 3)
            assert await _nothing_more(stream, 1.5)
        finally:
            await second.aclose()
        return (
            sorted(p["stream_seq"] for p, _ in again),
            [p["redeliveries"] for p, _ in again],
        )

    seqs, redeliveries = asyncio.run(main())
    assert seqs == [3, 5, 6]  # 1, 2 acked; 4 terminated
    assert all(r >= 1 for r in redeliveries)


def test_messages_a_vanished_producer_never_advanced_go_to_the_next_producer(
    nats_url, nats_conn, unique_name
) -> None:
    async def main() -> list[int]:
        await _stream(nats_url, unique_name, 5)
        first = _producer(nats_conn, unique_name, ack_wait=1)
        got = await _take(first.open_stream(), 5)
        got[0][0].handed_over()
        await first.advance([AdvanceItem(got[0][1], CLEAN)])
        await _vanish(first)  # yielded 2..5, never advanced them, no nak
        second = _producer(nats_conn, unique_name, ack_wait=1)
        try:
            again = await _take(second.open_stream(), 4)
        finally:
            await second.aclose()
        return sorted(p["stream_seq"] for p, _ in again)

    assert asyncio.run(main()) == [2, 3, 4, 5]


def test_messages_awaiting_persistence_are_not_redelivered_meanwhile(
    nats_url, nats_conn, unique_name
) -> None:
    """Held longer than ack_wait (Airflow persisting slowly) is not a reason to redeliver:
    that would be a duplicate without any failure."""

    async def main() -> tuple[bool, int]:
        await _stream(nats_url, unique_name, 3)
        producer = _producer(nats_conn, unique_name, ack_wait=1)
        try:
            stream = producer.open_stream()
            got = await _take(stream, 3)
            quiet = await _nothing_more(stream, 3.5)  # 3.5 x ack_wait
            for delivery, _ in got:
                delivery.handed_over()
            await producer.advance([AdvanceItem(m, CLEAN) for _, m in got])
            nc = await nats.connect(nats_url)
            info = await nc.jetstream().consumer_info(unique_name, "d1")
            await nc.close()
        finally:
            await producer.aclose()
        return quiet, info.num_redelivered + info.num_ack_pending

    assert asyncio.run(main()) == (True, 0)


def test_only_events_airflow_confirmed_persisted_are_acked(nats_url, nats_conn, unique_name):
    """Through Airflow's own SharedStreamManager, as the triggerer drives it: the events of
    6 messages are emitted, only the first 3 confirmed persisted; only those are acked, and
    the other 3 come back after the group stops (a triggerer restart)."""

    async def main() -> tuple[int, int, list[int]]:
        await _stream(nats_url, unique_name, 6)
        trigger = NatsMessageTrigger(stream=unique_name, durable="d1", nats_conn_id=nats_conn)
        key = trigger.shared_stream_key()
        manager = SharedStreamManager(ack_timeout=60)
        events = trigger.filter_shared_stream(
            manager.subscribe(trigger_id=1, trigger=trigger, key=key)
        )
        seqs = []
        for _ in range(6):  # what TriggerRunner.run_trigger does with each event
            await anext(events)
            seqs.append(manager.bind_pending_event(trigger_id=1, key=key))
        manager.confirm_persisted(seqs[:3])
        consumer = None
        async with asyncio.timeout(10):
            nc = await nats.connect(nats_url)
            while True:  # the advance pump runs asynchronously
                consumer = await nc.jetstream().consumer_info(unique_name, "d1")
                if consumer.ack_floor.stream_seq >= 3:
                    break
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        consumer = await nc.jetstream().consumer_info(unique_name, "d1")
        await nc.close()
        await events.aclose()
        await manager.unsubscribe(1, key)
        again = _producer(nats_conn, unique_name)
        try:
            redelivered = await _take(again.open_stream(), 3)
        finally:
            await again.aclose()
        return (
            consumer.ack_floor.stream_seq,
            consumer.num_ack_pending,
            sorted(p["stream_seq"] for p, _ in redelivered),
        )

    ack_floor, pending, redelivered = asyncio.run(main())
    assert (ack_floor, pending) == (3, 3)
    assert redelivered == [4, 5, 6]


def test_existing_consumer_reading_another_subject_is_refused_with_the_fix(
    nats_url, nats_conn, unique_name
) -> None:
    async def main() -> None:
        await _stream(nats_url, unique_name, 1)
        first = _producer(nats_conn, unique_name, subject=f"{unique_name}.a")
        try:
            await _nothing_more(first.open_stream(), 0.2)
        finally:
            await first.aclose()
        second = _producer(nats_conn, unique_name, subject=f"{unique_name}.b")
        try:
            await anext(second.open_stream())
        finally:
            await second.aclose()

    with pytest.raises(ConfigError, match="pass another durable="):
        asyncio.run(main())


def test_missing_stream_is_waited_for_naming_the_parameter_to_fix(
    nats_conn, unique_name, caplog
) -> None:
    """Waited for, not refused (issue 30; test_airflow_watcher_waits.py has the rest)."""

    async def main() -> None:
        producer = _producer(nats_conn, unique_name)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(3):
                    await anext(producer.open_stream())
        finally:
            await producer.aclose()

    with caplog.at_level("WARNING", logger="airflow_nats_ordered.triggers.messages"):
        asyncio.run(main())
    assert f"stream '{unique_name}' does not exist yet" in caplog.text
    assert "fix stream= if the name is wrong" in caplog.text


# --- a real triggerer, killed mid-stream ------------------------------------------------

WATCH_DAG = """
from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher

trigger = MessageQueueTrigger(
    scheme="nats", stream={stream!r}, subject={subject!r}, durable="airflow-e2e",
    nats_conn_id={conn_id!r}, ack_wait=3, fetch_timeout=1,
)
asset = Asset({asset!r}, watchers=[AssetWatcher(name="nats_watch", trigger=trigger)])
with DAG(dag_id={asset!r}, schedule=[asset], is_paused_upon_creation=False):
    EmptyOperator(task_id="triage")
"""
FIRED = re.compile(r"Trigger fired event.*?'stream_seq': (\d+)")


@pytest.mark.slow  # real triggerers for a minute: make test-slow, one at a time
def test_no_message_lost_when_the_triggerer_is_killed_mid_stream(
    nats_server, unique_name, tmp_path
) -> None:
    """N messages, a real ``airflow triggerer`` SIGKILLed (whole process group) while asset
    events flow, a second triggerer started: every message is an asset event, and a
    message appears twice only if the first triggerer had already handed it over."""
    n, kill_at = 300, 60
    home, db = private_home(tmp_path / "airflow")  # no other test's triggers in it
    asset, conn_id = unique_name.lower(), "nats_e2e"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "watch.py").write_text(
        WATCH_DAG.format(
            stream=unique_name, subject=f"{unique_name}.>", conn_id=conn_id, asset=asset
        )
    )
    env = {
        **home,
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(
            {"conn_type": "nats", "host": nats_server.url}
        ),
    }
    t0 = time.monotonic()
    asyncio.run(_stream(nats_server.url, unique_name))
    airflow("dags", "reserialize", env=env)  # parses the DAG: registers the watcher's trigger
    assert query(
        db,
        "select t.classpath from trigger t join asset_watcher w on w.trigger_id = t.id "
        "join asset a on a.id = w.asset_id where a.name = ?",
        asset,
    ) == [(CLASSPATH,)]
    t_registered = time.monotonic()

    def events() -> list[dict]:
        rows = query(
            db,
            "select e.extra from asset_event e join asset a on a.id = e.asset_id "
            "where a.name = ? order by e.id",
            asset,
        )
        return [json.loads(extra)["payload"] for (extra,) in rows]

    def seqs() -> list[int]:
        return [e["stream_seq"] for e in events()]

    first = Triggerer(tmp_path / "triggerer-1.log", env).start()
    second = Triggerer(tmp_path / "triggerer-2.log", env)
    try:

        async def publish_and_kill() -> tuple[list[int], set[int], float]:
            nc = await nats.connect(nats_server.url)
            js = nc.jetstream()
            try:
                await js.publish(f"{unique_name}.m", b"0")
                async with asyncio.timeout(90):  # triggerer start-up
                    while not seqs():
                        await asyncio.sleep(0.2)
                t_up = time.monotonic()
                at_kill: list[int] = []
                for i in range(1, n):  # paced, so the kill lands while events flow
                    await js.publish(f"{unique_name}.m", str(i).encode())
                    await asyncio.sleep(0.02)
                    if not at_kill and i % 5 == 0 and len(seqs()) >= kill_at:
                        first.kill()
                        at_kill = seqs()  # what the killed triggerer stored
                        # what it had been handed: the events its log shows fired (the
                        # log may lag on a loaded machine) and every message the server
                        # had delivered to its consumer (fetched: handed to the trigger)
                        fired = {int(s) for s in FIRED.findall(first.log())}
                        info = await js.consumer_info(unique_name, "airflow-e2e")
                        fired |= set(range(1, info.delivered.stream_seq + 1))
                assert at_kill, "the triggerer was not killed while messages were flowing"
                return at_kill, fired, t_up
            finally:
                await nc.close()

        at_kill, fired_at_kill, t_up = asyncio.run(publish_and_kill())
        t_killed = time.monotonic()
        second.start()
        deadline = time.monotonic() + 90
        while len(set(final := seqs())) < n and time.monotonic() < deadline:
            time.sleep(0.5)
        t_done = time.monotonic()
    finally:
        first.kill()
        second.stop()

    in_flight = fired_at_kill - set(at_kill)  # handed to the trigger, not yet stored
    duplicates = sorted(s for s in set(final) if final.count(s) > 1)
    print(
        f"\ntriggerer kill test: {n} messages; registration {t_registered - t0:.1f}s, "
        f"first triggerer up {t_up - t_registered:.1f}s, killed with {len(at_kill)} stored and "
        f"{len(in_flight)} handed over but not stored; all {n} stored "
        f"{t_done - t_killed:.1f}s after the kill; {len(duplicates)} duplicate(s); "
        f"total {t_done - t0:.1f}s"
    )
    assert sorted(set(final)) == list(range(1, n + 1)), "a message never became an asset event"
    assert len(at_kill) == len(set(at_kill)), "a duplicate without any failure"
    # a message is stored twice only if the killed triggerer had it: a redelivery
    assert set(duplicates) <= fired_at_kill | set(at_kill)
    # those handed over but not stored at the kill (what an ack-before-store trigger
    # loses) were stored after the restart, as JetStream redeliveries
    redelivered = {e["stream_seq"] for e in events() if e["redeliveries"] > 0}
    assert in_flight, "the kill did not land between hand-over and storage (nothing proven)"
    assert in_flight <= redelivered


# --- dead letters start a triage DAG ----------------------------------------------------


def test_dead_letter_trigger_receives_what_a_real_worker_dead_lettered(
    nats_url, nats_conn, unique_name
) -> None:
    """The subject and stream the helper watches are the ones the worker publishes to."""
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
    from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
    from airflow_nats_ordered.core.worker.config import WorkerConfig
    from airflow_nats_ordered.core.worker.worker import Worker

    def handler(msg: Any) -> None:
        if msg.data == b"poison":
            raise ValueError("cannot parse amount")

    async def main() -> dict:
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2, subject_prefix="shop.x"))
        async with OrderedPublisher(nc, unique_name) as pub:
            for data in (b"ok", b"poison", b"ok"):
                await pub.publish("k1", data)
        cfg = WorkerConfig(unique_name, "billing", member_id="m1", max_retries=0, lease_ttl=2)
        worker = Worker(nc, cfg, handler)
        await worker.start()
        try:
            async with asyncio.timeout(20):
                while worker.stats["dead_lettered"] < 1:
                    await asyncio.sleep(0.05)
        finally:
            await worker.stop()
            await nc.close()
        trigger = dead_letter_trigger(
            unique_name, "billing", subject_prefix="shop.x", nats_conn_id=nats_conn
        )
        producer = NatsMessageTrigger.create_shared_stream_producer(trigger.serialize()[1])
        try:
            [(payload, _)] = await _take(producer.open_stream(), 1)
        finally:
            await producer.aclose()
        return payload

    payload = asyncio.run(main())
    assert payload["stream"] == f"{unique_name}_DLQ"
    assert payload["subject"].startswith("shop.x.dlq.billing.")
    assert payload["data"] == "poison"
    assert "cannot parse amount" in payload["headers"]["Nats-Ordered-Error"]
    assert json.loads(payload["headers"]["Nats-Ordered-Origin"])["group"] == "billing"


def test_example_dead_letter_dag_imports_without_a_server(monkeypatch) -> None:
    import importlib.util
    import sys

    dags = ROOT / "dags"
    monkeypatch.syspath_prepend(str(dags))  # the DAG imports its helpers beside it
    monkeypatch.delitem(sys.modules, "flights", raising=False)
    spec = importlib.util.spec_from_file_location(
        "dead_letter_triage", dags / "dead_letter_triage.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from flights.operations import dead_letter_asset
    from flights.settings import FlightsSettings

    asset = dead_letter_asset(FlightsSettings.from_env())
    [watcher] = asset.watchers
    classpath, kwargs = watcher.trigger.serialize()
    assert classpath == CLASSPATH
    assert (kwargs["stream"], kwargs["subject"]) == ("FLIGHTS_DLQ", "flights.dlq.aircraft-totals.*")
    assert module.dag.dag_id == "dead_letter_triage"
