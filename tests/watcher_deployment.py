"""One ``nats://`` asset watcher deployed on real Airflow processes, for the watcher's
crash tests: a private Airflow home and metadata DB (see :mod:`airflow_processes`), a DAG
whose asset watches a fresh stream through ``MessageQueueTrigger(scheme="nats")``, and
what the tests read back: the asset events stored, the watcher's durable consumer, the
triggerers' "Trigger fired event" log lines."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import nats
from airflow_processes import Triggerer, airflow, private_home, query

from airflow_nats_ordered.triggers.messages import NatsMessageTrigger

WATCH_DAG = """
from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher

trigger = MessageQueueTrigger(scheme="nats", **{kwargs!r})
asset = Asset({asset!r}, watchers=[AssetWatcher(name="w", trigger=trigger)])
with DAG(dag_id={asset!r}, schedule=[asset], is_paused_upon_creation=False):
    EmptyOperator(task_id="t")
"""
FIRED = re.compile(r"Trigger fired event.*?'stream_seq': (\d+)")


def wait_for(what: str, ok: Callable[[], object], timeout: float = 120) -> None:
    """Poll ``ok`` until it is truthy; AssertionError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)


class WatcherDeployment:
    """Stream ``name`` (subjects ``name.>``), asset and DAG ``name.lower()`` watching it
    (``ack_wait=2``: a dead triggerer's messages come back 2 s later), registered
    (``airflow dags reserialize``) unless ``register=False``. The stream is created now
    unless ``create_stream=False`` (then :meth:`make_stream` creates it)."""

    def __init__(
        self,
        tmp_path: Path,
        nats_url: str,
        name: str,
        register: bool = True,
        create_stream: bool = True,
    ) -> None:
        self.tmp_path, self.url, self.stream = tmp_path, nats_url, name
        self.asset = self.dag_id = name.lower()
        conn_id = "nats_watcher_crash"
        self.trigger_kwargs = dict(
            stream=name,
            subject=f"{name}.>",
            nats_conn_id=conn_id,
            ack_wait=2,
            fetch_timeout=1,
            batch=10,
        )
        home, self.db = private_home(tmp_path / "airflow")
        dags = tmp_path / "dags"
        dags.mkdir()
        (dags / "watch.py").write_text(
            WATCH_DAG.format(kwargs=self.trigger_kwargs, asset=self.asset)
        )
        self.env = {
            **home,
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps({"conn_type": "nats", "host": nats_url}),
        }
        self.consumer = NatsMessageTrigger(**self.trigger_kwargs).consumer_name
        self.published = 0
        self.triggerers: list[Triggerer] = []
        if create_stream:
            self.make_stream()
        if register:
            self.airflow("dags", "reserialize")

    def make_stream(self) -> None:
        """Create the watched stream (subjects ``<name>.>``)."""

        async def main() -> None:
            nc = await nats.connect(self.url)
            try:
                await nc.jetstream().add_stream(name=self.stream, subjects=[f"{self.stream}.>"])
            finally:
                await nc.close()

        asyncio.run(main())

    def airflow(self, *args: str) -> None:
        airflow(*args, env=self.env)

    def triggerer(self, name: str) -> Triggerer:
        t = Triggerer(self.tmp_path / f"triggerer-{name}.log", self.env).start()
        self.triggerers.append(t)
        return t

    def kill_all(self) -> None:
        for t in self.triggerers:
            t.kill()

    def publish(self, n: int = 1, body: bytes = b"x") -> list[int]:
        """Publish ``n`` messages; their stream sequences."""

        async def main() -> list[int]:
            nc = await nats.connect(self.url)
            try:
                js = nc.jetstream()
                return [(await js.publish(f"{self.stream}.m", body)).seq for _ in range(n)]
            finally:
                await nc.close()

        seqs = asyncio.run(main())
        self.published = max(self.published, *seqs)
        return seqs

    def stored(self) -> list[int]:
        """The stream sequences of the asset's events, one per event (duplicates kept)."""
        rows = query(
            self.db,
            "select e.extra from asset_event e join asset a on a.id = e.asset_id where a.name = ?",
            self.asset,
        )
        return [json.loads(extra)["payload"]["stream_seq"] for (extra,) in rows]

    def lost(self) -> list[int]:
        return sorted(set(range(1, self.published + 1)) - set(self.stored()))

    def consumer_state(self) -> tuple[int, int, int]:
        """The watcher's consumer: ``(ack floor, messages held unacked, messages not yet
        delivered)``."""

        async def main() -> tuple[int, int, int]:
            nc = await nats.connect(self.url)
            try:
                info = await nc.jetstream().consumer_info(self.stream, self.consumer)
            finally:
                await nc.close()
            return info.ack_floor.stream_seq, info.num_ack_pending, info.num_pending

        return asyncio.run(main())

    def settled(self) -> bool:
        """Every message published is acked and the consumer holds none: nothing more
        will become an asset event."""
        floor, held, waiting = self.consumer_state()
        return floor >= self.published and not held and not waiting

    def caught_up(self) -> bool:
        """Every message published has an asset event and the consumer has acked it."""
        return not self.lost() and self.settled()

    def wait_final(self, timeout: float = 120) -> list[int]:
        """Wait until the consumer has settled (every message stored, or acked without
        one: a loss), then an ``ack_wait`` more for a late redelivery; the lost ones."""
        wait_for("the watcher's consumer to settle", self.settled, timeout)
        time.sleep(3)
        return self.lost()

    @staticmethod
    def fired(t: Triggerer) -> set[int]:
        """The stream sequences whose events triggerer ``t`` logged as fired."""
        return {int(s) for s in FIRED.findall(t.log())} if t.log_path.exists() else set()
