"""A partition a worker holds (:class:`OwnedPartition`): its lease, grant, task and state.

Shared by membership (:mod:`.worker`: claimed, renewed, revoked, lost) and delivery
(:mod:`.delivery`: processed, blocked, committed and released by the partition's task).
"""

from __future__ import annotations

import asyncio

from airflow_nats_ordered.core.group.commits import Grant
from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.worker.committer import PartitionCommitter


class OwnedPartition:
    """A partition this member holds: its lease, grant and task."""

    def __init__(self, partition: int, lease: Lease, grant: Grant) -> None:
        self.partition = partition
        self.lease = lease
        self.grant = grant
        self.task: asyncio.Task[None] | None = None
        self.revoke = asyncio.Event()
        self.processed = 0
        self.blocked: str | None = None
        # renewals and the final commit + release of one lease never interleave
        self.lock = asyncio.Lock()
        self.releasing = False
        self.finishing = False  # the partition task is in its clean-up (commit, release, revoke)
        self.lost = False
        self.processed_once = False
        #: the partition task's background commit writer (set by the task while it runs)
        self.committer: PartitionCommitter | None = None
        #: (key header, base64 key header) -> route_key's (key, rejection) on this partition
        self.routed: dict[tuple[str | None, str | None], tuple[str | None, str | None]] = {}
