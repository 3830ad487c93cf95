"""A group's state as ``status`` shows it: :class:`GroupState` and the problems an operator
must act on.

Guarantees: the snapshot is read with plain gets and is never used to decide ownership;
``problems`` names every blocked partition (its blocked marker, with the reason), every
deleted commit record, a deleted or re-created stream, a repartition whose switch point
is not recorded yet (once, with the command that completes it), and each member's own
reported problems, and a stopped global-order reader's error (from its position), each with the
action that fixes it.
:class:`GroupSnapshot` holds this verb; :class:`~.store.GroupStore` has one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import StreamNotFoundError
from airflow_nats_ordered.core.group.commits import CommitRecord
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.global_position import POSITION_KEY, READER_KEY, GlobalPosition
from airflow_nats_ordered.core.group.stream_identity import GroupStreamIdentity
from airflow_nats_ordered.core.stream.kv import bucket_keys
from airflow_nats_ordered.core.stream.layout import key_partition, pending_switch_problem, state_key
from airflow_nats_ordered.core.stream.partitioned import describe


@dataclass
class GroupState:
    """A snapshot for ``status``: read with plain gets, never used for ownership."""

    leases: dict[int, tuple[str, int]] = field(default_factory=dict)  # p -> (member, rev)
    commits: dict[int, CommitRecord] = field(default_factory=dict)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    leader: str | None = None
    assignment: bytes | None = None
    blocked: dict[int, str] = field(default_factory=dict)
    #: a global-order reader's position (key ``global`` of the state bucket), if any: its
    #: per-partition stream sequences are the group's committed positions
    global_position: GlobalPosition | None = None
    #: a running global-order reader's heartbeat (key ``global`` of the lease bucket); it is
    #: also listed in ``members`` under its member id
    global_reader: dict[str, Any] | None = None
    #: the layout epoch the group processes (its commits, leases and markers above are
    #: that epoch's), the stream's current epoch and its last switch point (see .layout)
    epoch: int = 0
    stream_epoch: int = 0
    switch_seq: int = 0
    #: the epoch of a layout whose switch point is not recorded yet (a repartition running
    #: or interrupted; see .layout), else None
    pending_switch: int | None = None
    #: what needs an operator: blocked partitions, deleted commit records, a deleted or
    #: re-created stream, and each member's own ``problems`` (from its heartbeat) prefixed
    #: with the member id
    problems: list[str] = field(default_factory=list)


def blocked_problems(blocked: dict[int, str]) -> list[str]:
    """One problem per blocked partition (its ``blocked.<n>`` marker): the partition
    processes nothing until the message is dealt with, whatever its lag says."""
    return [
        f"partition {p} is blocked: {reason}. Fix the handler and restart the group's "
        "workers (the next owner retries the message), or run them with the dead-letter "
        "policy (`--poison dead-letter`) to set the message aside"
        for p, reason in sorted(blocked.items())
    ]


class GroupSnapshot:
    """The ``status`` snapshot of a group, read from its lease bucket ``leases`` and state
    bucket ``state``; a re-created stream is told as its ``identity`` tells it.

    ``epoch`` gives the layout epoch the group works on now (the snapshot shows that
    epoch's keys, see :func:`~..stream.layout.state_key`): the store's, which moves when
    the group moves to another layout."""

    def __init__(
        self,
        nc: NATS,
        cfg: GroupConfig,
        leases: KeyValue,
        state: KeyValue,
        identity: GroupStreamIdentity,
        epoch: Callable[[], int],
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.leases = leases
        self.state = state
        self.identity = identity
        self.epoch = epoch

    async def snapshot(self) -> GroupState:
        """Read the group's state for ``status``, with ``problems`` an operator must act on."""
        snap = GroupState()
        recorded_stream = ""
        buckets = (
            (self.leases, self.cfg.lease_bucket, "lease"),
            (self.state, self.cfg.state_bucket, "state"),
        )
        for kv, bucket, prefix in buckets:
            for key in await bucket_keys(self.nc, bucket):
                try:
                    e = await kv.get(key)
                except (KeyNotFoundError, KeyDeletedError):
                    continue
                val = e.value or b""
                if prefix == "lease":
                    if (p := key_partition(key, self.epoch(), "p")) is not None:
                        snap.leases[p] = (json.loads(val)["member"], e.revision or 0)
                    elif key.startswith("m."):
                        snap.members[key[2:]] = json.loads(val)
                    elif key == "leader":
                        snap.leader = json.loads(val)["member"]
                    elif key == READER_KEY:
                        snap.global_reader = json.loads(val)
                        member = str(snap.global_reader.get("member") or "global-reader")
                        snap.members[member] = snap.global_reader
                else:
                    # keys of the group's layout epoch only (see .layout.state_key)
                    if (p := key_partition(key, self.epoch(), "c")) is not None:
                        snap.commits[p] = CommitRecord.from_json(val)
                    elif key == state_key(self.epoch(), "assignment"):
                        snap.assignment = val
                    elif (p := key_partition(key, self.epoch(), "blocked")) is not None:
                        snap.blocked[p] = val.decode()
                    elif key == POSITION_KEY:
                        snap.global_position = GlobalPosition.from_json(val)
                    elif key == "stream":
                        recorded_stream = json.loads(val).get("created", "")
        snap.epoch = self.epoch()
        snap.problems = await self._stream_problems(recorded_stream, snap)
        snap.problems += blocked_problems(snap.blocked)
        snap.problems += await self._deleted_commit_problems(snap.commits)
        gp = snap.global_position
        if gp is not None and gp.error and snap.global_reader is None:
            snap.problems.append(
                f"global-order reader {gp.member or '-'} stopped: {gp.error}. Deal with the "
                "cause and start the reader again (`nats-ordered global-read --stream "
                f"{self.cfg.stream} --group {self.cfg.group} ...`): it resumes after its position"
            )
        # a member holding a partition reports the reason its marker holds: said once above
        said = {f"partition {p}: {reason}" for p, reason in snap.blocked.items()}
        said.update(snap.problems)  # a member's pending-switch report: said once above
        for m, info in sorted(snap.members.items()):
            snap.problems += [f"{m}: {p}" for p in info.get("problems") or [] if p not in said]
        return snap

    async def _stream_problems(self, recorded: str, snap: GroupState) -> list[str]:
        try:
            live = await describe(self.nc, self.cfg.stream)
        except StreamNotFoundError:
            snap.stream_epoch = self.epoch()
            return [
                f"stream {self.cfg.stream} does not exist: the group's positions refer to a "
                f"deleted stream (remove the group: `nats-ordered group delete --stream "
                f"{self.cfg.stream} --group {self.cfg.group}`)"
            ]
        snap.stream_epoch = live.current_epoch
        snap.switch_seq = max((lay.switch_seq for lay in live.layouts), default=0)
        if recorded and live.created and recorded != live.created:
            return [self.identity.recreated_message(recorded, live.created)]
        pending = live.pending_switch
        if pending is not None:
            # its records may not all be stored, and no group moves past it: the operator
            # completes the repartition (members waiting on it say the same, said once)
            snap.pending_switch = pending.epoch
            return [
                pending_switch_problem(
                    live.name, live.current_partitions, live.current_epoch, pending.epoch
                )
            ]
        return []

    async def _deleted_commit_problems(self, commits: dict[int, CommitRecord]) -> list[str]:
        """Partitions whose ``c.<n>`` has a delete marker (it existed, then was deleted);
        not one whose record appeared after ``commits`` was read."""
        prefix = f"$KV.{self.cfg.state_bucket}.{state_key(self.epoch(), 'c')}."
        info = await jetstream(self.nc).stream_info(
            f"KV_{self.cfg.state_bucket}", subjects_filter=f"{prefix}*"
        )
        candidates = sorted(
            int(subject[len(prefix) :])
            for subject in info.state.subjects or {}
            if subject[len(prefix) :].isdigit() and int(subject[len(prefix) :]) not in commits
        )
        # the keys were listed before this read: a record a member wrote since (a new group's
        # first grant) is not in ``commits`` but is no deleted one either
        gone = []
        for p in candidates:
            try:
                await self.state.get(state_key(self.epoch(), "c", p))
            except (KeyNotFoundError, KeyDeletedError):
                gone.append(p)
        return [
            f"partition {p}: commit record {state_key(self.epoch(), 'c', p)} was deleted; the "
            "member that claims it next applies its missing_commit policy: fail (the default: "
            "the partition is not processed), earliest or latest (--missing-commit earliest|latest)"
            for p in gone
        ]
