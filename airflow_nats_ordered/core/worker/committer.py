"""A partition's commit writes off the hot path (:class:`PartitionCommitter`).

Guarantees: at most one commit write of a partition is in flight at any time, and what is
written is the latest position submitted when the previous write was answered (positions
in between are coalesced, never written out of order: each write is the compare-and-set of
:meth:`~..group.commits.GroupCommits.commit` on the grant's revision). A write is on the wire when
:meth:`PartitionCommitter.submit` returns if none was in flight; otherwise the latest
position is sent as soon as the answer to the write in flight is read (:mod:`..group.cas_writes`),
without waiting for the partition's task or any other. So a write reaches the server while
the handler goes on, and a crash re-delivers only what was handled after it was sent.
Nothing is written once the partition's lease is no longer valid locally, or after
:meth:`~PartitionCommitter.settle` or :meth:`~PartitionCommitter.cancel`; a write refused
because a newer owner bumped the token is kept in :attr:`PartitionCommitter.fenced` for the
partition's task to raise (it stops at once). A write that failed for a transient reason (a
server blip, no answer within :data:`ANSWER_TIMEOUT`) is tried again with the next
submitted position, or on its own after :data:`RETRY_AFTER` seconds (doubling while it
keeps failing, up to :data:`RETRY_MAX`) if none is submitted: a partition that went idle
right after a blip still gets its last position written. The handler never waits for a
commit's round trip, except when more than the caller's bound is uncommitted
(:meth:`~PartitionCommitter.wait_behind`); the partition's final commit (hand-over) is
written by the caller after ``settle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.js.errors import APIError

from airflow_nats_ordered.core.errors import exc_text
from airflow_nats_ordered.core.group.commits import Fenced, Grant
from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.group.store import GroupStore

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

#: how long a commit write waits for the server's answer before it counts as failed (the
#: JetStream API's default timeout, which KeyValue.update used)
ANSWER_TIMEOUT = 5.0

#: seconds after a failed write before its position is sent again when nothing newer is
#: submitted meanwhile (doubled after each failure in a row, up to RETRY_MAX)
RETRY_AFTER = 0.2
RETRY_MAX = 5.0

#: a position to commit: (stream sequence, its msg-id, how many messages it covers)
_Want = tuple[int, str | None, int]


class PartitionCommitter:
    """Writes ``grant``'s commit record in the background (see the module docstring)."""

    def __init__(self, store: GroupStore, grant: Grant, lease: Lease, member: str) -> None:
        self.store = store
        self.grant = grant
        self.lease = lease
        self.member = member
        #: set when a write was refused because a newer owner exists
        self.fenced: Fenced | None = None
        #: commit writes the server accepted
        self.writes = 0
        #: how many messages (counted by the caller) the last accepted write covers
        self.committed_count = 0
        self._want: _Want | None = None
        #: the write on the wire (awaiting its answer), or being checked after a refusal
        self._sent: _Want | None = None
        self._closed = False
        self._again = 0  # writes sent again in a row after adopting a revision
        self._failures = 0  # writes failed in a row (only the first is a warning)
        self._checking: asyncio.Task[None] | None = None
        #: set whenever a write ends (answered, failed or given up)
        self._ended = asyncio.Event()
        #: the timer that sends a failed write's position again, and the send it started
        self._retry: asyncio.TimerHandle | None = None
        self._retry_after = RETRY_AFTER
        self._retrying: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        """A write is in flight (or its refusal is being checked)."""
        return self._sent is not None

    async def submit(self, seq: int, msg_id: str | None, count: int = 0) -> None:
        """Ask for ``seq`` (the ``count``-th message handled, for :meth:`wait_behind`) to be
        committed: on the wire when this returns if no write is in flight, else sent once
        the write in flight is answered. Never waits for an answer."""
        if self.fenced is not None or self._closed:
            return
        self._want = (seq, msg_id, count)
        if self._sent is None:
            await self._send()

    async def _send(self) -> None:
        want = self._want
        if want is None or self._closed or self.fenced is not None or not self.lease.valid:
            return  # never after the lease is lost: a newer owner may exist
        self._want, self._sent = None, want
        try:
            await self.store.send_commit(
                self.grant, want[0], want[1], self._answered, ANSWER_TIMEOUT
            )
        except Exception as exc:  # disconnected, or worse
            self._end_failed(want, exc)

    async def _answered(self, result: int | BaseException) -> None:
        """The answer to the write in flight (from the task reading the socket, or a timer)."""
        want = self._sent
        if want is None or self._closed:
            return  # settled or cancelled meanwhile: the caller owns the record now
        if isinstance(result, int):
            self.store.commit_accepted(self.grant, want[0], want[1], result)
            self._accepted(want)
            await self._send()  # the position queued meanwhile, on the wire at once
        elif isinstance(result, APIError) and result.err_code == 10071:
            # the compare-and-set failed: a newer owner, or a lost reply of our own; the
            # check reads the record, which must not happen in the task reading the socket
            self._checking = asyncio.ensure_future(self._check(want, result))
        else:
            self._end_failed(want, result)

    async def _check(self, want: _Want, exc: APIError) -> None:
        try:
            done = await self.store.commit_refused(self.grant, want[0], exc)
        except Fenced as fenced:
            self.fenced = fenced
            self._sent = None
            self._ended.set()
            return
        except Exception as error:
            self._end_failed(want, error)
            return
        if self._closed:
            return
        if done:
            self._accepted(want)
        else:
            self._again += 1
            if self._again > 5:
                self.fenced = Fenced(
                    f"partition {self.grant.partition}: the commit record keeps changing "
                    f"under token {self.grant.token} (two tasks committing one grant?); "
                    "this member stops processing it"
                )
                self._sent = None
                self._ended.set()
                return
            if self._want is None:
                self._want = want  # on the revision just adopted
            self._sent = None
            self._ended.set()
        await self._send()

    def _accepted(self, want: _Want) -> None:
        self._again = 0
        if self._failures:
            log.info(
                "member %s: committing partition %d works again (at %d, after %d failed writes)",
                self.member,
                self.grant.partition,
                want[0],
                self._failures,
            )
            self._failures = 0
        self._retry_after = RETRY_AFTER
        self.writes += 1
        self.committed_count = max(self.committed_count, want[2])
        self._sent = None
        self._ended.set()

    def _end_failed(self, want: _Want, exc: BaseException) -> None:
        self._sent = None
        self._ended.set()
        if self._closed:
            return
        # one warning per outage: a synchronous handler's partition commits every few ms,
        # so a state-bucket leader election (no responders) gave hundreds a second
        self._failures += 1
        log.log(
            logging.WARNING if self._failures == 1 else logging.DEBUG,
            "member %s: committing partition %d at %d failed (%s); will retry",
            self.member,
            self.grant.partition,
            want[0],
            exc_text(exc),
        )
        if self._want is None:
            self._want = want  # retried with the next submit, or by the timer
        if self._retry is None and self.fenced is None:
            # a partition that goes idle submits nothing more: its last position must not
            # wait for the next message (the record would lag what was handled: a drain
            # waits for its timeout, a crash re-delivers the whole idle partition's tail)
            self._retry = asyncio.get_running_loop().call_later(self._retry_after, self._retry_now)
            self._retry_after = min(RETRY_MAX, 2 * self._retry_after)

    def _retry_now(self) -> None:
        self._retry = None
        if self._closed or self._sent is not None or self._want is None:
            return  # stopped, or a write is in flight (it sends the position after it)
        self._retrying = asyncio.ensure_future(self._send())

    async def _until(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._ended.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._ended.wait()

    async def wait_behind(self, count: int, bound: int, timeout: float) -> None:
        """Backpressure: while more than ``bound`` of the first ``count`` messages handled
        are not committed and a write is in flight, wait for it (at most ``timeout``
        seconds, so a server that does not answer slows the partition down without
        stopping it). This bounds what a crash re-delivers even when writes take long; the
        other partitions use the CPU meanwhile."""
        await self._until(lambda: count - self.committed_count <= bound or not self.busy, timeout)

    async def wait_answered(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until no write is in flight."""
        await self._until(lambda: not self.busy, timeout)

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the write in flight and the one queued behind
        it to end; after that nothing more is written (a late answer is ignored), so the
        caller may write the record itself."""
        await self._until(lambda: not self.busy, timeout)
        self.cancel()

    def cancel(self) -> None:
        """Stop writing (a crash-like stop: nothing more is committed)."""
        self._want = None
        self._closed = True
        self._sent = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._checking is not None and not self._checking.done():
            self._checking.cancel()
