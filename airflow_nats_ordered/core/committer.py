"""A partition's commit writes off the hot path (:class:`PartitionCommitter`).

Guarantees: at most one commit write of a partition is in flight at any time, and what is
written is the latest position submitted when the previous write ended (positions in
between are coalesced, never written out of order: each write is the CAS of
:meth:`~.commits.GroupCommits.commit` on the grant's revision). Nothing is written once the
partition's lease is no longer valid locally, and a write refused because a newer owner
bumped the token is kept in :attr:`PartitionCommitter.fenced` for the partition's task to
raise (it stops at once). A write that failed for a transient reason (a server blip) is
tried again with the next submitted position. The handler never waits for a commit's
round trip: only the partition's final commit (hand-over) waits, after :meth:`settle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .commits import Fenced, Grant
from .group import GroupStore
from .leases import Lease

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker")


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
        self._want: tuple[int, str | None, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def submit(self, seq: int, msg_id: str | None, count: int = 0) -> None:
        """Ask for ``seq`` (the ``count``-th message handled, for :meth:`wait_behind`) to be
        committed; returns at once. A write already in flight is followed by one of the
        latest position submitted meanwhile."""
        if self.fenced is not None:
            return
        self._want = (seq, msg_id, count)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while self._want is not None:
            if not self.lease.valid:
                return  # never after the lease is lost: a newer owner may exist
            seq, msg_id, count = want = self._want
            self._want = None
            try:
                await self.store.commit(self.grant, seq, msg_id)
                self.writes += 1
                self.committed_count = max(self.committed_count, count)
            except Fenced as exc:
                self.fenced = exc
                return
            except Exception as exc:  # a server blip (NatsError, TimeoutError), or worse
                log.warning(
                    "member %s: committing partition %d at %d failed (%s); will retry",
                    self.member,
                    self.grant.partition,
                    seq,
                    exc,
                )
                if self._want is None:
                    self._want = want
                return  # retried with the next submit

    async def wait_behind(self, count: int, bound: int, timeout: float) -> None:
        """Backpressure: while more than ``bound`` of the first ``count`` messages handled
        are not committed, wait for the write in flight (at most ``timeout`` seconds, so a
        server that does not answer slows the partition down without stopping it). This
        bounds what a crash re-delivers even when a busy event loop makes every write take
        long; the other partitions use the CPU meanwhile."""
        task = self._task
        if count - self.committed_count > bound and task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout)

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the write in flight (and the one queued behind
        it) to end; cancel it after that. Afterwards no background write is running, so the
        caller may write the record itself."""
        task = self._task
        self._task = None
        if task is None or task.done():
            return
        await asyncio.wait({task}, timeout=timeout)  # (a cancelled caller stops here)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def cancel(self) -> None:
        """Stop writing (a crash-like stop: nothing more is committed)."""
        self._want = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
