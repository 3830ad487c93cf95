"""Every asset watcher gets every message, on any number of triggerers (issue 13 item 3).

JetStream hands each message of a durable consumer to only one of its readers, and Airflow
runs each Trigger row (one per distinct set of trigger arguments) on one triggerer. So a
durable must be read by one trigger identity only: without ``durable=`` each identity gets
its own consumer; with ``durable=`` the consumer is bound to the first identity and another
is refused with the fix. The end-to-end test runs two real ``airflow triggerer`` processes
that each hold one trigger of each pair.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats
import pytest
from airflow_processes import Triggerer, airflow, private_home, query

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.triggers.messages import (
    BINDING_ID,
    CLASSPATH,
    NatsMessageProducer,
    NatsMessageTrigger,
    arelease_durable,
    dead_letter_trigger,
)


@pytest.fixture
def nats_conn(monkeypatch: pytest.MonkeyPatch, nats_url: str) -> str:
    monkeypatch.setenv(
        "AIRFLOW_CONN_NATS_WATCHERS_TEST", json.dumps({"conn_type": "nats", "host": nats_url})
    )
    return "nats_watchers_test"


def _producer(**kw: Any) -> NatsMessageProducer:
    kwargs = NatsMessageTrigger(**kw).serialize()[1]
    return NatsMessageTrigger.create_shared_stream_producer(json.loads(json.dumps(kwargs)))


async def _stream(url: str, name: str, n: int = 0) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        for i in range(n):
            await js.publish(f"{name}.m", str(i).encode())
    finally:
        await nc.close()


async def _take(producer: NatsMessageProducer, n: int) -> list[int]:
    """Open the producer's stream and return the stream sequences of its first n messages."""
    stream = producer.open_stream()
    out = []
    async with asyncio.timeout(60):
        while len(out) < n:
            payload, _ = await anext(stream)
            out.append(payload["stream_seq"])
    return out


# --- identity, derived durables, arguments --------------------------------------------


def test_one_trigger_identity_is_one_derived_durable() -> None:
    a = NatsMessageTrigger(stream="ORDERS", subject="orders.>", ack_wait=3)
    same = NatsMessageTrigger(**json.loads(json.dumps(a.serialize()[1])))
    assert a.serialize()[1]["durable"] is None  # Airflow's Trigger row keeps what was given
    assert a.consumer_name == same.consumer_name
    assert a.consumer_name.startswith("airflow-watcher-")
    assert a.shared_stream_key() == same.shared_stream_key()
    # any argument that makes another Trigger row makes another consumer
    for change in (
        {"ack_wait": 4},
        {"subject": "orders.p.1"},
        {"nats_conn_id": "other"},
        {"batch": 7},
        {"max_in_flight": 9},
        {"deliver_policy": "new"},
        {"fetch_timeout": 2},
    ):
        other = NatsMessageTrigger(**{**a.serialize()[1], **change})
        assert other.consumer_name != a.consumer_name, change
        assert other.shared_stream_key() != a.shared_stream_key(), change


def test_triggers_with_other_arguments_on_one_durable_never_share_a_poll() -> None:
    """Sharing a poll would hide the conflict on one triggerer and split on two."""
    a = NatsMessageTrigger(stream="ORDERS", durable="d", ack_wait=3)
    b = NatsMessageTrigger(stream="ORDERS", durable="d", ack_wait=4)
    assert a.consumer_name == b.consumer_name == "d"
    assert a.shared_stream_key() != b.shared_stream_key()


@pytest.mark.parametrize(
    "make",
    [
        lambda: NatsMessageTrigger(stream="S", durable="d", subjects="s.>"),
        lambda: dead_letter_trigger("S", "g", subjects="s.>"),
        lambda: (
            __import__("airflow.providers.common.messaging.triggers.msg_queue", fromlist=["x"])
            .MessageQueueTrigger(scheme="nats", stream="S", durable="d", subjects="s.>")
            .trigger
        ),
    ],
    ids=["trigger", "dead_letter_trigger", "MessageQueueTrigger"],
)
def test_misspelt_argument_is_refused_with_the_valid_ones(make) -> None:
    with pytest.raises(ConfigError) as e:
        make()
    assert "subjects= (did you mean subject=?)" in str(e.value)
    assert "stream, durable, subject, nats_conn_id" in str(e.value)


# --- binding a durable, against a real server -----------------------------------------


def test_explicit_durable_refuses_a_trigger_with_other_arguments(nats_url, nats_conn, unique_name):
    """The same identity binds again (a second triggerer running the one Trigger row);
    a different one is refused naming the durable, the difference and the fixes."""
    common = {"stream": unique_name, "durable": "shared", "nats_conn_id": nats_conn}
    common |= {"batch": 2}  # a producer pulls 2 at a time: the first leaves 3, 4 to its twin

    async def main() -> tuple[list[int], list[int], str]:
        await _stream(nats_url, unique_name, 4)
        first, twin = _producer(**common, ack_wait=3), _producer(**common, ack_wait=3)
        other = _producer(**common, ack_wait=4)
        try:
            got = await _take(first, 2)
            got_twin = await _take(twin, 2)  # same identity: binds, shares the messages
            with pytest.raises(ConfigError) as refused:
                await _take(other, 1)
        finally:
            for p in (first, twin, other):
                await p.aclose()
        return got, got_twin, str(refused.value)

    got, got_twin, error = asyncio.run(main())
    assert sorted(got + got_twin) == [1, 2, 3, 4]
    assert f"durable='shared' of stream '{unique_name}' is bound to another watcher" in error
    assert "ack_wait=3.0 there, ack_wait=4.0 here" in error, error
    assert "omit durable=" in error and "release_durable(" in error


def test_two_identities_creating_one_durable_at_once_bind_only_one(
    nats_url, nats_conn, unique_name
):
    common = {"stream": unique_name, "durable": "raced", "nats_conn_id": nats_conn}

    async def main() -> list[Any]:
        await _stream(nats_url, unique_name, 1)
        producers = [_producer(**common, batch=b) for b in (1, 2, 3, 4)]
        try:
            return await asyncio.gather(*(_take(p, 1) for p in producers), return_exceptions=True)
        finally:
            for p in producers:
                await p.aclose()

    results = asyncio.run(main())
    assert sum(isinstance(r, list) for r in results) == 1, results
    assert all(isinstance(r, ConfigError) for r in results if not isinstance(r, list))


def test_a_durable_without_binding_is_adopted_at_its_position_and_can_be_released(
    nats_url, nats_conn, unique_name
) -> None:
    """A consumer from before the rule (or made by hand) keeps its position when a trigger
    adopts it; release_durable hands it, position kept, to a trigger with other arguments."""

    async def main() -> tuple[list[int], list[int], str | None]:
        await _stream(nats_url, unique_name, 6)
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.add_consumer(
            unique_name, durable_name="legacy", ack_policy="explicit", max_deliver=-1
        )
        sub = await js.pull_subscribe_bind("legacy", stream=unique_name)
        for m in await sub.fetch(2, timeout=10):
            await m.ack_sync()
        common = {"stream": unique_name, "durable": "legacy", "nats_conn_id": nats_conn}
        first = _producer(**common, ack_wait=3)
        try:
            adopted = await _take(first, 2)
        finally:
            await first.aclose()  # naks the two it held: they come back
        bound = (await js.consumer_info(unique_name, "legacy")).config.metadata[BINDING_ID]
        assert await arelease_durable(nc, unique_name, "legacy")
        await nc.close()
        changed = _producer(**common, ack_wait=5)
        try:
            after_release = await _take(changed, 4)
        finally:
            await changed.aclose()
        return adopted, after_release, bound

    adopted, after_release, bound = asyncio.run(main())
    assert adopted == [3, 4]
    assert sorted(after_release) == [3, 4, 5, 6]
    assert (
        bound
        == NatsMessageTrigger(
            stream=unique_name, durable="legacy", nats_conn_id=nats_conn, ack_wait=3
        ).identity
    )


def test_a_changed_watcher_without_durable_starts_over_at_deliver_policy(
    nats_url, nats_conn, unique_name
) -> None:
    """Changing an argument makes a new watcher (a new Trigger row, a new consumer): with
    the default deliver_policy it sees every message the stream holds again (duplicates,
    never a gap); the unchanged watcher keeps its position."""
    from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome

    common = {"stream": unique_name, "nats_conn_id": nats_conn}

    async def main() -> tuple[list[int], list[int], list[int]]:
        await _stream(nats_url, unique_name, 3)
        before = _producer(**common, ack_wait=3)
        try:
            stream = before.open_stream()
            got = [await anext(stream) for _ in range(3)]
            for delivery, _ in got:
                delivery.handed_over()
            await before.advance(
                [AdvanceItem(m, AdvanceOutcome(acked=1, failed=0)) for _, m in got]
            )
        finally:
            await before.aclose()
        await _stream_publish(nats_url, unique_name, 1)
        unchanged, changed = _producer(**common, ack_wait=3), _producer(**common, ack_wait=4)
        try:
            return (
                [p["stream_seq"] for p, _ in got],
                await _take(unchanged, 1),
                await _take(changed, 4),
            )
        finally:
            await unchanged.aclose()
            await changed.aclose()

    first, unchanged, changed = asyncio.run(main())
    assert first == [1, 2, 3]
    assert unchanged == [4]
    assert sorted(changed) == [1, 2, 3, 4]


async def _stream_publish(url: str, name: str, n: int) -> None:
    nc = await nats.connect(url)
    try:
        for i in range(n):
            await nc.jetstream().publish(f"{name}.m", str(i).encode())
    finally:
        await nc.close()


# --- two real triggerers ----------------------------------------------------------------

WATCHERS_DAG = """
from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher

for asset_name, extra in {watchers!r}:
    trigger = MessageQueueTrigger(
        scheme="nats", stream={stream!r}, subject={subject!r}, nats_conn_id={conn_id!r},
        fetch_timeout=1, **extra,
    )
    asset = Asset(asset_name, watchers=[AssetWatcher(name="w", trigger=trigger)])
    with DAG(dag_id=asset_name, schedule=[asset], is_paused_upon_creation=False):
        EmptyOperator(task_id="t")
"""


@pytest.mark.slow  # real triggerers for a minute: make test-slow, one at a time
def test_every_watcher_gets_every_message_on_two_triggerers(nats_server, unique_name, tmp_path):
    """Two DAG files, each with a watcher without durable= and a watcher on one explicit
    durable, arguments differing between the files (four Trigger rows). Triggerer 1 holds
    file 1's two triggers, triggerer 2 file 2's. 100 messages: both derived-durable
    watchers get all 100; on the shared explicit durable the first binding gets all 100
    and the other is refused with the error in its triggerer's log (none split)."""
    n = 100
    home, db = private_home(tmp_path / "airflow")  # no other test's triggers in it
    u, conn_id = unique_name.lower(), "nats_watchers_e2e"
    durable = f"shared-{u}"
    files = {
        1: [
            (f"{u}_derived_1", {"ack_wait": 3}),
            (f"{u}_shared_1", {"ack_wait": 3, "durable": durable}),
        ],
        2: [
            (f"{u}_derived_2", {"ack_wait": 4}),
            (f"{u}_shared_2", {"ack_wait": 4, "durable": durable}),
        ],
    }
    dags = tmp_path / "dags"
    dags.mkdir()
    env = {
        **home,
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__TRIGGERER__CAPACITY": "2",
        # no triggerer is killed here: a loaded machine can delay a heartbeat past the
        # 3 s the kill tests use, and the other triggerer would then take over this one's
        # triggers (the pairs would swap or split and the test would prove nothing)
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "120",
        f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(
            {"conn_type": "nats", "host": nats_server.url}
        ),
    }
    asyncio.run(_stream(nats_server.url, unique_name))

    def register(i: int) -> None:
        (dags / f"watchers_{i}.py").write_text(
            WATCHERS_DAG.format(
                watchers=files[i], stream=unique_name, subject=f"{unique_name}.>", conn_id=conn_id
            )
        )
        airflow("dags", "reserialize", env=env)

    def holders(i: int) -> list[Any]:
        """The triggerer_id of file i's two triggers (None: not assigned yet)."""
        return [
            row[0]
            for name, _ in files[i]
            for row in query(
                db,
                "select t.triggerer_id from trigger t join asset_watcher w on w.trigger_id = t.id "
                "join asset a on a.id = w.asset_id where a.name = ? and t.classpath = ?",
                name,
                CLASSPATH,
            )
        ]

    def counts() -> dict[str, list[int]]:
        out = {}
        for i in files:
            for name, _ in files[i]:
                rows = query(
                    db,
                    "select e.extra from asset_event e join asset a on a.id = e.asset_id "
                    "where a.name = ?",
                    name,
                )
                out[name] = sorted({json.loads(x)["payload"]["stream_seq"] for (x,) in rows})
        return out

    def wait(what: str, ok, seconds: float = 90) -> None:
        deadline = time.monotonic() + seconds
        while not ok():
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {t.log_path.name} (last 4000 characters):\n{t.log()[-4000:]}"
                    for t in (t1, t2)
                    if t.log_path.exists()
                )
                raise AssertionError(f"gave up waiting for {what}\n{tails}")
            time.sleep(0.3)

    t1 = Triggerer(tmp_path / "triggerer-1.log", env)
    t2 = Triggerer(tmp_path / "triggerer-2.log", env)
    try:
        register(1)
        assert len(holders(1)) == 2, "file 1's watchers were not registered as two triggers"
        t1.start()
        wait("triggerer 1 to hold file 1's triggers", lambda: None not in holders(1))
        wait("triggerer 1 to read both consumers", lambda: t1.log().count("reading stream") >= 2)
        register(2)
        assert len(holders(2)) == 2, "file 2's watchers were not registered as two triggers"
        t2.start()
        wait("triggerer 2 to hold file 2's triggers", lambda: None not in holders(2))
        (one,) = set(holders(1))
        (two,) = set(holders(2))
        assert one != two, "both pairs' triggers ran on one triggerer (nothing proven)"
        wait("triggerer 2 to read its derived consumer", lambda: "reading stream" in t2.log())
        wait("triggerer 2 to refuse the shared durable", lambda: "is bound to another" in t2.log())

        async def publish() -> None:
            nc = await nats.connect(nats_server.url)
            try:
                js = nc.jetstream()
                for i in range(n):
                    await js.publish(f"{unique_name}.m", str(i).encode())
            finally:
                await nc.close()

        asyncio.run(publish())
        everyone = [f"{u}_derived_1", f"{u}_derived_2", f"{u}_shared_1"]
        wait(
            "every watcher's asset events",
            lambda: all(len(counts()[a]) >= n for a in everyone),
        )
        time.sleep(2)  # anything split off to the refused watcher would show by now
        final = counts()
        assert set(holders(1)) == {one} and set(holders(2)) == {two}, "triggers moved"
        log2 = t2.log()
    finally:
        t1.stop()
        t2.stop()

    print(
        "\ntwo triggerers: events per asset "
        + ", ".join(f"{a.removeprefix(u + '_')}={len(s)}" for a, s in final.items())
    )
    for name in everyone:
        assert final[name] == list(range(1, n + 1)), f"{name} missed messages"
    assert final[f"{u}_shared_2"] == [], "the refused watcher read the shared durable"
    assert f"durable='{durable}' of stream '{unique_name}' is bound to another" in log2
