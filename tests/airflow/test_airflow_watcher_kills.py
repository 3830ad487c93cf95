"""No ``nats://`` watcher message is lost, whatever instant a triggerer is killed at
(issue 28 item 8).

Three real ``airflow triggerer`` processes (supervisor + trigger runner child each, HA
on one metadata DB) run a ``MessageQueueTrigger(scheme="nats")`` watcher while messages
are published: one runs the trigger, the others take it over in turn. Every stream
sequence must end up with an asset event; duplicates (redeliveries after a kill) are
allowed and counted. The kills:

1. **Caught up, ``kill -9`` of the ``airflow triggerer`` process alone**, and messages
   arrive at once. Its trigger runner lives on, orphaned, for up to a second: it takes
   a message, fails to log "Trigger fired event" to its dead supervisor (broken pipe),
   and leaves the shared stream sitting on that event, which Airflow resolves as
   accepted with nothing stored (a message every 20 ms until the runner is gone, so
   it takes one whatever its remaining lifetime). Before the fix the message was acked
   without an asset event: the loss of issue 28 item 8 (an early sequence missing, the
   ack floor past it, nothing pending). Another triggerer takes the trigger over once
   the killed one's heartbeat expires (``[triggerer] triggerer_health_check_threshold``, 6 s here).
2. **Stalled mid hand-over, then ``kill -9`` of all its processes.** The triggerer
   holding the trigger is stopped (SIGSTOP of the ``airflow triggerer`` process) right
   after its log shows an event fired; large messages then fill the runner's log
   socket, so its trigger blocks in the middle of a hand-over. Another triggerer takes
   the trigger over while the stalled one's runner still runs it (two triggerers run
   the one trigger row), fires events of its own, and then the stalled one is killed.

The windows themselves are pinned deterministically by
``test_airflow_watcher_handover.py`` (Airflow's ``SharedStreamManager`` driven step by
step) and ``test_airflow_watcher_removal.py`` (a trigger removed while its events are
stored).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from airflow_processes import Triggerer
from watcher_deployment import WatcherDeployment, wait_for

BIG = b"x" * 300_000  # the stalled triggerer's messages: their log lines fill the log socket


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh clone's first triggerers compile Airflow's bytecode
def test_no_message_lost_when_triggerers_are_killed_at_the_points_of_the_hand_over(
    nats_server, unique_name, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    w = WatcherDeployment(tmp_path, nats_server.url, unique_name, register=False)
    # all three start up at once, while the DAG is parsed (start-ups are most of the
    # cost); the first to look takes the trigger, the others take it over in turn
    live = [w.triggerer(name) for name in "abc"]
    w.airflow("dags", "reserialize")
    rounds: list[str] = []

    def holder(seq: int) -> Triggerer | None:
        """The live triggerer whose trigger fired message ``seq``'s event, if any."""
        return next((t for t in live if seq in w.fired(t)), None)

    try:
        # 1: caught up, the supervisor alone killed, messages arrive for its orphan runner
        w.publish()
        wait_for("message 1 stored and acked (a triggerer started)", w.caught_up, 300)
        first = holder(1)
        assert first is not None
        first.signal_main(signal.SIGKILL)
        assert first.proc is not None
        first.proc.wait(30)  # dead: a message taken from now on meets the broken pipe
        burst: list[int] = []
        deadline = time.monotonic() + 90
        while first.group_pids():  # its runner lives on: a message every 20 ms for it
            assert time.monotonic() < deadline, (
                f"the killed triggerer's runner lived on: {first.group_pids()}"
            )
            burst.extend(w.publish())
            time.sleep(0.02)
        live.remove(first)
        rounds.append(f"orphaned runner offered {burst}")
        # taken over: every message acked (stored, or lost: checked at the end)
        wait_for("the trigger taken over, the consumer settled", w.settled, 120)
        survivor = holder(w.published)
        assert survivor is not None
        other = next(t for t in live if t is not survivor)

        # 2: stalled in the middle of a hand-over, taken over, then killed whole
        target = w.publish()[0]
        wait_for(f"the survivor firing message {target}", lambda: holder(target) is survivor)
        survivor.signal_main(signal.SIGSTOP)
        stalled = w.publish(3, BIG)  # its runner takes them; their log lines block
        taken_over: list[int] = []

        def other_fires() -> bool:
            taken_over.extend(w.publish())  # new messages until the other one fires one
            time.sleep(0.5)
            return bool(w.fired(other) & set(taken_over))

        wait_for("another triggerer taking the trigger over", other_fires, 120)
        survivor.kill()
        live.remove(survivor)
        took = min(w.fired(other) & set(taken_over))
        rounds.append(f"stalled while holding {stalled}, taken over at {took}")
        lost = w.wait_final()
        seqs = w.stored()
    finally:
        w.kill_all()
    print(
        f"\nwatcher kills: {w.published} messages ({'; '.join(rounds)}); "
        f"{len(set(seqs))} stored, {len(seqs) - len(set(seqs))} duplicate(s), lost {lost}; "
        f"{time.monotonic() - t0:.0f}s"
    )
    assert not lost, f"messages acknowledged without an asset event: {lost} ({rounds})"
