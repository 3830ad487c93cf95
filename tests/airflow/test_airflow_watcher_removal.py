"""A ``nats://`` watcher whose trigger Airflow removes while its events are being stored
loses none of them (issue 28 item 8).

Airflow's triggerer stores a trigger's event with ``Trigger.submit_event``, which writes
an asset event for each asset the trigger row is associated with *at that moment*; when
the row was deleted or has no asset any more (the DAG paused or changed, and parsed
again), it writes nothing, returns normally, and the event is confirmed as persisted
all the same: the message would be acked without an asset event. The triggerer deletes
the row in the same round (``clean_unused``) and cancels the trigger in the reply that
carries those confirmations.

Here a real triggerer runs the watcher while messages keep coming; the DAG is paused
and parsed again (the watcher leaves the asset) in the middle of that burst, so the
triggerer stores the events of its next state sync for a trigger without assets. After
the DAG is unpaused (the watcher is back, a new trigger row on the same durable
consumer), every message must have an asset event.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import nats
import pytest
from airflow_processes import query
from watcher_deployment import WatcherDeployment, wait_for


@pytest.mark.slow  # real triggerers for a minute: make test-slow, one at a time
def test_events_stored_for_a_removed_watcher_trigger_are_not_acked(
    nats_server, unique_name, tmp_path: Path
) -> None:
    w = WatcherDeployment(tmp_path, nats_server.url, unique_name)
    t0 = time.monotonic()

    def triggers() -> int:
        return query(w.db, "select count(*) from trigger")[0][0]

    stop = threading.Event()
    seqs_published: list[int] = []

    def burst() -> None:
        """A message every 20 ms until told to stop."""

        async def main() -> None:
            nc = await nats.connect(w.url)
            try:
                js = nc.jetstream()
                while not stop.is_set():
                    seqs_published.append((await js.publish(f"{w.stream}.m", b"x")).seq)
                    await asyncio.sleep(0.02)
            finally:
                await nc.close()

        asyncio.run(main())

    publisher = threading.Thread(target=burst, name="burst")
    try:
        w.triggerer("1")
        w.publish()
        wait_for("message 1 stored and acked", w.caught_up)
        publisher.start()
        wait_for("the burst flowing into asset events", lambda: len(w.stored()) > 20)
        w.airflow("dags", "pause", w.dag_id)
        w.airflow("dags", "reserialize")  # the watcher leaves the asset
        wait_for("the trigger row deleted", lambda: triggers() == 0, 60)
        stop.set()
        publisher.join(30)
        assert not publisher.is_alive()
        w.published = max(seqs_published)
        w.airflow("dags", "unpause", w.dag_id)
        w.airflow("dags", "reserialize")  # the watcher is back: a new trigger row
        lost = w.wait_final()
        seqs = w.stored()
    finally:
        stop.set()
        w.kill_all()
    print(
        f"\nwatcher removed mid-burst: {w.published} messages, {len(set(seqs))} stored, "
        f"{len(seqs) - len(set(seqs))} duplicate(s), lost {lost}; {time.monotonic() - t0:.0f}s"
    )
    assert not lost, f"messages acknowledged without an asset event: {lost}"
