"""Resetting a consumer group's committed positions (Kafka's ``--reset-offsets``): the
plan (where each partition is and where it would go, nothing written) and the fenced reset.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.admin.membership import live_members
from airflow_nats_ordered.core.connection.api import api_subject, jetstream
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.group.lag import records_after
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import describe, partition_bounds, partition_stats
from airflow_nats_ordered.core.worker.epochs import group_layout

#: where :func:`reset_group` puts a group: ``"earliest"``, ``"latest"``, ``{partition:
#: sequence}``, one stream sequence for every partition (an int), or a time (an aware
#: datetime)
ResetTarget = Literal["earliest", "latest"] | Mapping[int, int] | int | dt.datetime


@dataclass(frozen=True)
class PartitionReset:
    """One partition of a reset plan: its committed position now and the one it gets, with
    the partition's messages (count, first and last sequence), its lease holder and its
    lag at each position (:mod:`..group.lag`: records after the position, as ``status`` counts)."""

    partition: int
    committed: int
    target: int
    first: int
    last: int
    messages: int
    owner: str | None
    lag_before: int
    lag_after: int


@dataclass(frozen=True)
class ResetPlan:
    """What :func:`reset_group` would do (:func:`plan_reset`), nothing written yet."""

    stream: str
    group: str
    partitions: list[PartitionReset]
    live_members: list[str]


async def _first_since(nc: NATS, stream: str, subject: str, when: dt.datetime) -> int | None:
    """The stream sequence of the first message on ``subject`` stored at or after ``when``
    (read from the stream leader), or None if there is none."""
    req = {"start_time": when.astimezone(dt.UTC).isoformat(), "next_by_subj": subject}
    resp = await nc.request(
        api_subject(nc, f"STREAM.MSG.GET.{stream}"), json.dumps(req).encode(), timeout=5.0
    )
    body = json.loads(resp.data or b"{}")
    if "error" in body:
        if body["error"].get("code") == 404:
            return None
        raise NatsOrderedError(
            f"reading stream {stream} at {when.isoformat()} failed: "
            f"{body['error'].get('description')}"
        )
    return int(body["message"]["seq"])


async def plan_reset(
    nc: NATS,
    stream: str,
    group: str,
    *,
    to: ResetTarget,
    partitions: Sequence[int] | None = None,
) -> ResetPlan:
    """Where :func:`reset_group` would put each partition, and where it is now; writes
    nothing. Every target is checked here, so a reset is all or nothing. Raises
    :class:`~..errors.ConfigError` for a target or partition that does not exist, and
    NatsOrderedError when the group has no state."""
    # the partitions of the layout the group reads (a repartitioned stream's earlier one
    # while the group has not finished it)
    described = await group_layout(nc, await describe(nc, stream), group)
    if isinstance(to, bool):
        raise ConfigError(f"a reset target is a position, not {to!r}")
    if isinstance(to, str) and to not in ("earliest", "latest"):
        raise ConfigError(
            f"to must be 'earliest', 'latest', a sequence, a time or {{partition: seq}}, got {to!r}"
        )
    if isinstance(to, Mapping):
        chosen = sorted(int(p) for p in to) if partitions is None else list(partitions)
    else:
        chosen = list(range(described.partitions)) if partitions is None else list(partitions)
    wrong = [p for p in chosen if not 0 <= p < described.partitions]
    if wrong:
        raise ConfigError(
            f"stream {stream} has partitions 0 to {described.partitions - 1}; {wrong} do not exist"
        )
    if isinstance(to, int):
        stream_last = int((await jetstream(nc).stream_info(stream)).state.last_seq or 0)
        if not 0 <= to <= stream_last:
            raise ConfigError(
                f"sequence {to} is not a position of stream {stream}: it must be 0 to "
                f"{stream_last} (its last message); a position past the end would skip "
                "messages not yet published"
            )
    if isinstance(to, dt.datetime) and to.tzinfo is None:
        raise ConfigError(f"the time {to.isoformat()} has no time zone: give it one (UTC: +00:00)")
    targets: dict[int, tuple[int, int, int]] = {}  # p -> (target, first, last)
    for p in chosen:
        first, last = await partition_bounds(nc, described, p)
        if isinstance(to, str):
            targets[p] = (max(0, first - 1) if to == "earliest" else last, first, last)
        elif isinstance(to, int):  # one stream-wide position: past the partition's end = its end
            targets[p] = (min(to, last), first, last)
        elif isinstance(to, dt.datetime):
            since = await _first_since(nc, stream, described.subject(p), to)
            targets[p] = (last if since is None else since - 1, first, last)
        else:
            seq = int(to[p])
            if not 0 <= seq <= last:
                raise ConfigError(
                    f"the position of partition {p} must be 0 to {last} (its last message), "
                    f"got {seq}: a position past the end would skip messages not yet published"
                )
            targets[p] = (seq, first, last)
    store = await GroupStore.attach(nc, stream, group)
    snap = await store.snapshot()
    counts = {s.partition: s.messages for s in await partition_stats(nc, described)}
    plan = []
    for p, (seq, first, last) in targets.items():
        rec, _ = await store.read_commit(p)
        owner = snap.leases.get(p, (None, 0))[0]
        committed = rec.seq if rec else 0
        before, after = await asyncio.gather(
            records_after(nc, stream, described.subject(p), committed),
            records_after(nc, stream, described.subject(p), seq),
        )
        plan.append(
            PartitionReset(p, committed, seq, first, last, counts.get(p, 0), owner, before, after)
        )
    return ResetPlan(stream, group, plan, await live_members(nc, stream, group))


@dataclass(frozen=True)
class GroupReset:
    """What :func:`reset_group` did: per partition ``(previous position, new position)``."""

    stream: str
    group: str
    positions: dict[int, tuple[int, int]]
    live_members: list[str]
    #: the plan it carried out (each partition's position, messages and owner before)
    plan: ResetPlan | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "group": self.group,
            "positions": {str(p): {"from": a, "to": b} for p, (a, b) in self.positions.items()},
            "live_members": self.live_members,
        }


async def reset_group(
    nc: NATS,
    stream: str,
    group: str,
    *,
    to: ResetTarget,
    partitions: Sequence[int] | None = None,
    confirm: bool = False,
) -> GroupReset:
    """Rewind or skip a group's committed positions (Kafka's ``--reset-offsets``).

    ``to``: ``"earliest"`` (re-process everything still in the stream), ``"latest"`` (skip
    everything stored so far), ``{partition: sequence}`` (the next message processed is
    the first after that sequence), a stream sequence for every partition (an int: each
    partition resumes with its first message after it), or an aware datetime (each
    partition resumes with its first message stored at or after it; a partition with none
    skips to its end). ``partitions`` limits it (default: all, or the mapping's).
    :func:`plan_reset` shows the same without writing.

    Fenced: each reset record carries a new fencing token, so a running member's next commit
    fails and it hands the partition over; nobody can write an old position back. The sink
    is not touched: to re-apply messages it already applied, reset the sink as well (a
    fenced sink ignores sequences at or below its last applied one). Refuses without
    ``confirm=True``: a reset is how data gets processed twice or skipped.
    """
    if not confirm:
        raise ConfigError(
            f"resetting group {group} of stream {stream} re-processes or skips messages: pass "
            "confirm=True to do it"
        )
    plan = await plan_reset(nc, stream, group, to=to, partitions=partitions)
    store = await GroupStore.attach(nc, stream, group)
    done: dict[int, tuple[int, int]] = {}
    for part in plan.partitions:
        before, _ = await store.reset(part.partition, part.target)
        done[part.partition] = (before, part.target)
    return GroupReset(stream, group, done, plan.live_members, plan)
