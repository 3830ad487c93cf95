"""The ordered publisher's one sender task: every partition's acknowledgements and windows.

Internal to :class:`~.publisher.OrderedPublisher` (what it uses of it is
:class:`~.lane._LaneOwner`). A partition's lane (:mod:`.lane`)
opens, commits, recovers and fails its batches in its own task, but in the steady state
(a batch open and its flow known, records queued or lingering) it *parks* and this task
serves it: it applies the lane's acknowledgements and sends whatever its window then
allows. One wake-up serves every lane with work, and their frames go out in one write,
instead of one task wake-up, one reply wait and one write per partition and
acknowledgement (issue 19 item 1: up to a third of the client's CPU on 16 partitions went
to spreading the records over concurrent lanes; ``docs/benchmarks-publisher.md``).

What it guarantees: it changes no message and no order. Each lane's frames are built and
numbered exactly as the lane builds them, in one place at a time (the sender only serves a
parked lane, whose task does not write), and they reach the connection through
:func:`.wire.send_frames` like every other message of the publisher. Anything but a plain
acknowledgement of the current batch (an error, a gap, the batch's final ack), a failed
write, a full batch and an emptied queue the lane must commit are handed back to the lane's
task, which handles them exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

from airflow_nats_ordered.core.publish import wire

if TYPE_CHECKING:
    from airflow_nats_ordered.core.publish.lane import _Lane, _LaneOwner

log = logging.getLogger("airflow_nats_ordered.core.publish.publisher")


class _Sender:
    """Serves parked lanes: ``kick`` a lane with new replies or new records, and the task
    applies its acknowledgements and sends its window, for every kicked lane in one pass."""

    def __init__(self, pub: _LaneOwner) -> None:
        self.pub = pub
        self.ready: list[_Lane] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.run())

    def kick(self, lane: _Lane) -> None:
        """Have the task serve ``lane`` (parked) on its next pass."""
        if not lane.kicked:
            lane.kicked = True
            self.ready.append(lane)
            self.wake.set()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            ready, self.ready = self.ready, []
            try:
                await self._serve(ready)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # hand every lane of the pass back to its own task
                log.exception("the publisher's sender failed")
                for lane in ready:
                    lane.kicked = False
                    lane.sender_error = f"unexpected sender error: {exc!r}"
                    lane.wake.set()

    async def _serve(self, ready: list[_Lane]) -> None:
        frames: list[bytes] = []
        written: list[_Lane] = []
        payload = largest = 0
        now = time.monotonic()
        for lane in ready:
            lane.kicked = False
            if not lane.parked:  # its task runs: it handles its replies and queue itself
                continue
            acked = lane.acked_bseq
            if lane.replies and not lane.take_acks():
                lane.wake.set()  # a reply only the lane handles
                continue
            got = lane.window(frames) if lane.queue else None
            if got is not None:
                payload += got[0]
                largest = max(largest, got[1])
                written.append(lane)
            if got is not None or lane.acked_bseq != acked:
                lane.progress_at = now  # its ack timeout and linger count from here
            if lane.needs_task():
                lane.wake.set()
        if not frames:
            return
        try:
            await wire.send_frames(self.pub.nc, self.pub._fast, frames, payload, largest)
        except NatsError as exc:
            for lane in written:  # none of them may count on its window: resend
                lane.sender_error = f"send failed: {type(exc).__name__}: {exc}"
                lane.wake.set()
