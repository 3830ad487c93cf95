"""What the parts of one member share (:class:`MemberContext`).

A :class:`~.worker.Worker` is assembled from parts, each an object it constructs: the
heartbeat (:mod:`.heartbeat`), the leader (:mod:`.leader`), the reconcile loop claiming and
revoking partitions (:mod:`.reconcile`), the delivery of owned partitions to the handler
(:mod:`.delivery`), the watch on the group's presence (:mod:`.presence`) and the epoch switch
(:mod:`.epochs`). What more than one of them reads or changes is here, and nothing else:

* the connection, the settings and the member id;
* the group's store and the stream (as the member's layout epoch sees it: the epoch
  switch replaces it, so parts read it here at each use, never keep a copy);
* the partitions the member holds (:attr:`MemberContext.owned`: claimed by the reconcile
  loop, renewed and lost by the heartbeat, processed and released by delivery, handed back
  by the epoch switch and by ``stop()``);
* the member's statistics and problems (every part counts and reports), its audit trail,
  and whether it is stopping.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.owned import OwnedPartition


class MemberContext:
    """The state a member's parts share (see the module docstring)."""

    def __init__(self, nc: NATS, config: WorkerConfig) -> None:
        self.nc = nc
        self.cfg = config
        self.member = config.member_id
        #: the group's store (opened by ``Worker.start``)
        self.store: GroupStore
        #: the stream in the member's layout epoch (set by :meth:`.epochs.EpochSwitch.enter`)
        self.stream: PartitionedStream
        self.owned: dict[int, OwnedPartition] = {}
        #: set once ``stop()`` began: no loop starts anything new
        self.stopping = False
        self.stats = {
            "processed": 0,
            "handler_errors": 0,
            "retries": 0,
            "dead_lettered": 0,
            "fenced": 0,
            "leases_lost": 0,
            "rebalances": 0,
            #: records never handed to the handler: misrouted, keyless on a keyed stream,
            #: malformed key (each also dead-lettered or blocked on)
            "rejected": 0,
            #: partitions stopped for an operator: a position no longer in the stream's
            #: history (its stored state went back), a message the sink can neither apply
            #: nor skip
            "stopped": 0,
        }
        #: what keeps failing, by topic; published in the heartbeat (``status`` shows it)
        self.problems: dict[str, str] = {}

    def report(self, topic: str, problem: str | None) -> None:
        """Set (or with None clear) the problem of ``topic``; the next heartbeat publishes
        the list under ``problems``, and ``status`` shows it."""
        if problem is None:
            self.problems.pop(topic, None)
        elif self.problems.get(topic) != problem:
            self.problems[topic] = problem

    def audit(self, **event: Any) -> None:
        if self.cfg.audit_log is None:
            return
        line = json.dumps({"member": self.member, "pid": os.getpid(), **event}) + "\n"
        fd = os.open(self.cfg.audit_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
        finally:
            os.close(fd)

    def audit_lease(self, p: int, lease: Lease, token: int) -> None:
        """A validity window in wall-clock time: from now (the claim or renewal is confirmed;
        nothing is processed before) to the lease's deadline (its send time + TTL - margin)."""
        now_wall, now_mono = time.time(), time.monotonic()
        until = now_wall + (lease.valid_until - now_mono)
        self.audit(kind="lease", partition=p, token=token, valid_from=now_wall, valid_until=until)

    def call_bound(self) -> float:
        """How long one group-state call of the background loops may wait for an answer:
        one renewal interval, at least a second. A KV call to a bucket whose stream is
        electing a leader gets no answer at all; giving up early retries it soon after
        the election instead of after nats-py's 5 s timeout."""
        return max(1.0, self.cfg.group_config.renew_interval)
