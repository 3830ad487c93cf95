"""No ``nats://`` watcher message is lost, whatever instant the triggerer is killed at
(issue 28 item 8).

A real ``airflow triggerer`` (supervisor process + trigger runner child) reads a stream
through a ``MessageQueueTrigger(scheme="nats")`` watcher while messages are published. It
is killed several times, each time right after its log shows the trigger handing a given
message's event over ("Trigger fired event": the event is yielded, the triggerer has not
stored it yet); the next triggerer, started beforehand, takes the trigger over and is
killed in turn, and the last one reads what is left. Every stream
sequence must end up with an asset event; duplicates (redeliveries after a kill) are
allowed and counted. The kinds of kill (see ``KILLS``):

* ``process``: ``kill -9`` of the ``airflow triggerer`` process alone, as ``kill -9
  <pid>`` does; its trigger runner child lives on, orphaned, for a moment;
* ``group``: ``kill -9`` of all its processes (a container killed);
* ``stalled``: the ``airflow triggerer`` process is stopped (SIGSTOP: a stall) while
  large messages arrive, so the runner's trigger blocks in the middle of a hand-over
  (the "Trigger fired event" log line cannot be written), then SIGKILLed there.

The window itself (a stopping trigger's event reported stored) is pinned
deterministically by ``test_airflow_watcher_handover.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import nats
from airflow_processes import Triggerer, airflow, private_home, query

from airflow_nats_ordered.triggers.messages import NatsMessageTrigger

WATCH_DAG = """
from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher

trigger = MessageQueueTrigger(
    scheme="nats", stream={stream!r}, subject={subject!r}, nats_conn_id={conn_id!r},
    ack_wait=2, fetch_timeout=1, batch=10,
)
asset = Asset({asset!r}, watchers=[AssetWatcher(name="w", trigger=trigger)])
with DAG(dag_id={asset!r}, schedule=[asset], is_paused_upon_creation=False):
    EmptyOperator(task_id="t")
"""
FIRED = re.compile(r"Trigger fired event.*?'stream_seq': (\d+)")

#: (how, right after the event of which message of the round fired): the kill points
KILLS = [("stalled", 2), ("process", 5), ("group", 3)]
PER_ROUND = 10  # messages published per round (the kill lands among them)
BIG = b"x" * 300_000  # a stalled round's messages: their log lines fill the log socket


def test_no_message_lost_when_the_triggerer_is_killed_at_any_point_of_the_hand_over(
    nats_server, unique_name, tmp_path: Path
) -> None:
    home, db = private_home(tmp_path / "airflow")
    asset, conn_id = unique_name.lower(), "nats_kills"
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

    async def make_stream() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().add_stream(name=unique_name, subjects=[f"{unique_name}.>"])
        finally:
            await nc.close()

    asyncio.run(make_stream())
    airflow("dags", "reserialize", env=env)

    def stored() -> list[int]:
        rows = query(
            db,
            "select e.extra from asset_event e join asset a on a.id = e.asset_id where a.name = ?",
            asset,
        )
        return [json.loads(extra)["payload"]["stream_seq"] for (extra,) in rows]

    def fired(t: Triggerer) -> set[int]:
        return {int(s) for s in FIRED.findall(t.log())} if t.log_path.exists() else set()

    consumer = NatsMessageTrigger(
        stream=unique_name,
        subject=f"{unique_name}.>",
        nats_conn_id=conn_id,
        ack_wait=2,
        fetch_timeout=1,
        batch=10,
    ).consumer_name

    async def consumer_done(n: int) -> bool:
        """The watcher's consumer acknowledged messages 1..n and holds none."""
        nc = await nats.connect(nats_server.url)
        try:
            info = await nc.jetstream().consumer_info(unique_name, consumer)
        finally:
            await nc.close()
        return info.ack_floor.stream_seq >= n and not info.num_ack_pending and not info.num_pending

    triggerers: list[Triggerer] = []  # every one started, for the final clean-up
    live: list[Triggerer] = []  # started and not killed
    rounds: list[str] = []

    def start(name: str) -> None:
        t = Triggerer(tmp_path / f"triggerer-{name}.log", env).start()
        triggerers.append(t)
        live.append(t)

    def holder(seq: int) -> Triggerer | None:
        """The live triggerer whose trigger fired message ``seq``'s event, if any."""
        return next((t for t in live if seq in fired(t)), None)

    async def one_round(i: int, how: str, after: int, published: int) -> int:
        """Once the round's first message is stored, publish the rest and kill (``how``)
        the triggerer that fires the round's message ``after``. The next triggerer is
        started first: it starts up meanwhile and takes the trigger over after the kill."""
        start(str(i + 1))
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            first = (await js.publish(f"{unique_name}.m", b"x")).seq
            published += 1
            async with asyncio.timeout(120):  # start-up, taking over the trigger, storing
                while first not in stored():
                    await asyncio.sleep(0.1)
            target = first + after
            async with asyncio.timeout(60):
                while (t := holder(target)) is None:
                    if published < first + PER_ROUND - 1:
                        body = BIG if how == "stalled" else b"x"
                        await js.publish(f"{unique_name}.m", body)
                        published += 1
                    await asyncio.sleep(0.01)
            if how == "stalled":  # its trigger is handing large events over: stall it
                t.signal_main(signal.SIGSTOP)  # the log lines stop being read
                await js.publish(f"{unique_name}.m", BIG)  # one more for it to take
                published += 1
                await asyncio.sleep(1)
            if how == "group":
                t.kill()
            else:
                t.signal_main(signal.SIGKILL)
            assert t.proc is not None
            t.proc.wait(30)
            live.remove(t)
            killed_at = max(fired(t))
            while published < first + PER_ROUND - 1:  # the round's rest, for the next one
                await js.publish(f"{unique_name}.m", b"x")
                published += 1
        finally:
            await nc.close()
        assert t.wait_gone(90), f"a killed triggerer's runner lived on: {t.group_pids()}"
        rounds.append(f"{how} after firing seq {target} (its log showed up to {killed_at})")
        return published

    published = 0
    try:
        start("1")
        for i, (how, after) in enumerate(KILLS, 1):
            published = asyncio.run(one_round(i, how, after, published))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if set(stored()) == set(range(1, published + 1)):
                break
            if asyncio.run(consumer_done(published)):  # acked all: nothing more will come
                break
            time.sleep(0.5)
        time.sleep(3)  # ack_wait + a fetch: a late redelivery would show by now
        seqs = stored()
    finally:
        for t in triggerers:
            t.kill()

    lost = sorted(set(range(1, published + 1)) - set(seqs))
    duplicates = len(seqs) - len(set(seqs))
    print(
        f"\nwatcher kills: {published} messages, {len(KILLS)} kills "
        f"({'; '.join(rounds)}); {len(set(seqs))} stored, {duplicates} duplicate(s), "
        f"lost {lost}; {time.monotonic() - t0:.0f}s"
    )
    assert not lost, f"messages acknowledged without an asset event: {lost} ({rounds})"
