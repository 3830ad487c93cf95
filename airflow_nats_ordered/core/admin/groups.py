"""Administering a consumer group as a whole: its live members, its dead letters, deleting it.

A group's state is two KV buckets, ``nor_<stream>_<group>_leases`` and
``nor_<stream>_<group>_state`` (see :mod:`..group.store`). Its dead letters live in the stream
``<STREAM>_DLQ`` on the subjects ``<prefix>.dlq.<group>.<partition>``; that stream is shared
by every group of the stream, so deleting a group removes its dead letters only when asked,
and the dead-letter stream itself only once nothing is left in it and no other group of the
stream has state.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    NotFoundError,
)

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.group.assignor import Assignment, assign, imbalance, moves
from airflow_nats_ordered.core.group.global_position import READER_KEY
from airflow_nats_ordered.core.group.lag import records_after
from airflow_nats_ordered.core.group.store import GroupConfig, GroupStore, RebalancePolicy
from airflow_nats_ordered.core.stream.kv import bucket_keys
from airflow_nats_ordered.core.stream.partitioned import describe, partition_bounds, partition_stats
from airflow_nats_ordered.core.worker.epochs import group_layout

#: Suffix of the dead-letter stream of a partitioned stream: ``ORDERS`` -> ``ORDERS_DLQ``.
DEAD_LETTER_SUFFIX = "_DLQ"


def dead_letter_stream(stream: str) -> str:
    """The name of the stream holding the dead letters of every group of ``stream``."""
    return f"{stream}{DEAD_LETTER_SUFFIX}"


class GroupInUseError(NatsOrderedError):
    """The group still has live members; ``members`` names them."""

    def __init__(self, message: str, members: list[str]) -> None:
        super().__init__(message)
        self.members = members


class GroupNotFoundError(NatsOrderedError):
    """Neither of the group's buckets exists (and, when they were to be purged, it has no
    dead letters). ``dead_letters_kept`` counts the group's dead letters left in place
    because purging them was not asked for, so a caller can word the fix in its own terms
    (the Python API's ``dead_letters=True``, the CLI's ``--dead-letters``)."""

    def __init__(self, message: str, stream: str, group: str, dead_letters_kept: int = 0) -> None:
        super().__init__(message)
        self.stream = stream
        self.group = group
        self.dead_letters_kept = dead_letters_kept


@dataclass(frozen=True)
class DeadLetters:
    """Where a group's dead letters are and how many there are (0 if the stream is absent)."""

    stream: str
    subjects: str
    messages: int
    exists: bool


@dataclass(frozen=True)
class GroupDeleted:
    """What :func:`delete_group` removed."""

    stream: str
    group: str
    buckets: list[str] = field(default_factory=list)
    #: live members at the time of a forced delete (they crash on their next KV access)
    live_members: list[str] = field(default_factory=list)
    dead_letters_purged: int = 0
    dead_letter_stream_deleted: bool = False
    #: why the dead-letter stream was kept when dead letters were purged, if it was
    dead_letter_stream_kept: str | None = None


async def live_members(nc: NATS, stream: str, group: str) -> list[str]:
    """Members whose heartbeat (``m.<id>`` in the lease bucket) has not expired, and a
    running global-order reader of the group (its heartbeat, key ``global``), so a drain's
    no-members check and ``group delete`` see it too."""
    bucket = GroupConfig(stream, group).lease_bucket
    try:
        kv = await nc.jetstream().key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        return []
    members = []
    for key in await bucket_keys(nc, bucket, "m."):
        try:
            await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue  # left (deleted) or expired meanwhile
        members.append(key[2:])
    try:
        reader = await kv.get(READER_KEY)
    except (KeyNotFoundError, KeyDeletedError):
        return members
    member = json.loads(reader.value or b"{}").get("member") or "global-order reader"
    return [*members, str(member)]


async def dead_letter_prefix(nc: NATS, stream: str) -> str | None:
    """The subject prefix of ``stream``'s dead-letter stream (from its ``<prefix>.dlq.>``
    subject, so it is known even when the partitioned stream is gone); None if absent."""
    try:
        info = await nc.jetstream().stream_info(dead_letter_stream(stream))
    except NotFoundError:
        return None
    for subject in info.config.subjects or []:
        if subject.endswith(".dlq.>"):
            return subject[: -len(".dlq.>")]
    return None


async def dead_letters(nc: NATS, stream: str, group: str) -> DeadLetters:
    """Count ``group``'s dead letters in ``<stream>_DLQ``."""
    name = dead_letter_stream(stream)
    prefix = await dead_letter_prefix(nc, stream)
    if prefix is None:
        return DeadLetters(name, f"<prefix>.dlq.{group}.*", 0, exists=False)
    subjects = f"{prefix}.dlq.{group}.*"
    info = await nc.jetstream().stream_info(name, subjects_filter=subjects)
    return DeadLetters(name, subjects, sum((info.state.subjects or {}).values()), exists=True)


#: :func:`dead_letters` under a name a ``dead_letters`` parameter does not hide
_count_dead_letters = dead_letters


async def _other_groups(nc: NATS, stream: str, group: str) -> list[str]:
    """State buckets of other groups that may belong to ``stream``. Conservative: a bucket
    of a stream whose name starts with ``<stream>_`` matches too (names are ambiguous)."""
    ours = GroupConfig(stream, group).state_bucket
    head, tail = f"KV_nor_{stream}_", "_state"
    found: list[str] = []
    js = nc.jetstream()
    offset = 0
    while True:
        page = await js.streams_info(offset)
        if not page:
            return sorted(found)
        offset += len(page)
        for info in page:
            name = info.config.name or ""
            if name.startswith(head) and name.endswith(tail) and name[3:] != ours:
                found.append(name[3:])


async def delete_group(
    nc: NATS,
    stream: str,
    group: str,
    *,
    force: bool = False,
    dead_letters: bool = False,
) -> GroupDeleted:
    """Delete ``group``'s two KV buckets: its leases, commits, fencing tokens and assignment.

    Refuses (:class:`GroupInUseError`) while members are alive unless ``force=True``: a
    forced delete under running members makes them fail, and a member that starts again
    begins the stream from its first message. With ``dead_letters=True`` the group's
    subjects in ``<stream>_DLQ`` are purged, and the dead-letter stream is deleted when it
    is then empty and no other group of the stream has state. Raises
    :class:`GroupNotFoundError` when there is nothing to delete.
    """
    cfg = GroupConfig(stream, group)
    members = await live_members(nc, stream, group)
    if members and not force:
        raise GroupInUseError(
            f"group {group} of stream {stream} has {len(members)} live member(s): "
            f"{', '.join(members)}. Stop its workers first (they leave the group on SIGTERM), "
            "or pass force=True to delete it under them",
            members,
        )
    js = nc.jetstream()
    deleted: list[str] = []
    for bucket in (cfg.lease_bucket, cfg.state_bucket):
        try:
            await js.delete_key_value(bucket)
        except NotFoundError:
            continue
        deleted.append(bucket)
    purged, dlq_deleted, kept = 0, False, None
    if dead_letters:
        purged, dlq_deleted, kept = await _remove_dead_letters(nc, stream, group)
    if not deleted and not purged and not dlq_deleted:
        left = 0 if dead_letters else (await _count_dead_letters(nc, stream, group)).messages
        raise GroupNotFoundError(
            f"group {group} of stream {stream} does not exist: no bucket {cfg.lease_bucket} "
            f"or {cfg.state_bucket}"
            + (
                f"; its {left} dead letter(s) are kept: pass dead_letters=True to purge them"
                if left
                else ""
            ),
            stream,
            group,
            left,
        )
    return GroupDeleted(
        stream,
        group,
        buckets=deleted,
        live_members=members,
        dead_letters_purged=purged,
        dead_letter_stream_deleted=dlq_deleted,
        dead_letter_stream_kept=kept,
    )


async def _remove_dead_letters(nc: NATS, stream: str, group: str) -> tuple[int, bool, str | None]:
    """Purge the group's dead-letter subjects; delete the dead-letter stream if it is then
    empty and no other group may still publish to it. Returns (purged, deleted, why kept)."""
    found = await dead_letters(nc, stream, group)
    if not found.exists:
        return 0, False, None
    js = nc.jetstream()
    if found.messages:
        await js.purge_stream(found.stream, subject=found.subjects)
    left = (await js.stream_info(found.stream)).state.messages
    if left:
        return found.messages, False, f"it still holds {left} dead letter(s) of other groups"
    others = await _other_groups(nc, stream, group)
    if others:
        return (
            found.messages,
            False,
            f"other groups may still dead-letter into it (buckets {', '.join(others)})",
        )
    with contextlib.suppress(NotFoundError):  # deleted meanwhile: the outcome asked for
        await js.delete_stream(found.stream)
    return found.messages, True, None


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
        f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps(req).encode(), timeout=5.0
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
        stream_last = int((await nc.jetstream().stream_info(stream)).state.last_seq or 0)
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


@dataclass(frozen=True)
class Rebalanced:
    """What :func:`rebalance_group` did: the moves ``partition -> (old owner, new owner)``,
    the generation in force, and (with weights) the imbalance before and after."""

    stream: str
    group: str
    generation: int
    moves: dict[int, tuple[str | None, str]]
    owners: dict[int, str]
    imbalance_before: float | None
    imbalance_after: float | None
    settled_in: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "group": self.group,
            "generation": self.generation,
            "moves": {str(p): {"from": a, "to": b} for p, (a, b) in self.moves.items()},
            "owners": {str(p): m for p, m in self.owners.items()},
            "imbalance_before": self.imbalance_before,
            "imbalance_after": self.imbalance_after,
            "settled_in": round(self.settled_in, 3),
        }


async def rebalance_group(
    nc: NATS,
    stream: str,
    group: str,
    *,
    cordon: Sequence[str] = (),
    weights: Mapping[int, float] | None = None,
    slack: float | None = 0.0,
    timeout: float = 60.0,
) -> Rebalanced:
    """Ask the group's leader for a new assignment now and wait until it has settled
    (every partition's lease held by its assigned owner).

    ``cordon``: members to take every partition away from (before maintenance); it stays in
    force until the next rebalance request without them. ``weights``: per-partition load
    (e.g. :func:`partition_rates`); movement stays minimal for the given ``slack`` (how far
    above the average load a member may stay; 0 balances as tightly as the weights allow).
    Raises :class:`NatsOrderedError` if no leader applies the request in ``timeout`` (no
    member running) or the group does not settle.
    """
    t0 = time.monotonic()
    store = await GroupStore.attach(nc, stream, group)
    data, _ = await store.read_assignment()
    before = Assignment.from_json(data) if data else None
    wanted_weights = {int(p): float(w) for p, w in (weights or {}).items()}
    # refuse here what the leader could not obey (bad weights, cordoning every member)
    members_now = await live_members(nc, stream, group)
    partitions = (await group_layout(nc, await describe(nc, stream), group)).partitions
    try:
        assign(
            partitions,
            members_now,
            before,
            weights=wanted_weights or None,
            cordon=cordon,
            slack=slack if wanted_weights else None,
        )
    except ValueError as exc:
        raise ConfigError(f"rebalance of group {group} refused: {exc}") from None
    request = uuid.uuid4().hex
    while True:
        policy, rev = await store.read_policy()
        wanted = RebalancePolicy(
            cordon=sorted(set(cordon)),
            weights=wanted_weights,
            slack=slack,
            request=request,
            applied=policy.applied,
        )
        if await store.write_policy(wanted, rev) is not None:
            break
    deadline = t0 + timeout
    while True:
        policy, _ = await store.read_policy()
        if policy.applied == request:
            if policy.error:  # membership changed in between (e.g. the last one cordoned)
                raise NatsOrderedError(f"group {group}: {policy.error}")
            break
        if policy.request != request:
            raise NatsOrderedError(
                f"another rebalance request for group {group} replaced this one; check "
                f"`nats-ordered status --stream {stream} --group {group}`"
            )
        if time.monotonic() > deadline:
            raise NatsOrderedError(
                f"no leader of group {group} (stream {stream}) applied the rebalance within "
                f"{timeout:g}s: are its workers running? (`nats-ordered status --stream "
                f"{stream} --group {group}`)"
            )
        await asyncio.sleep(0.1)
    data, _ = await store.read_assignment()
    after = Assignment.from_json(data) if data else Assignment(0, {})
    members = await live_members(nc, stream, group)  # idle and cordoned ones count too
    while True:
        snap = await store.snapshot()
        unsettled = {
            p: owner for p, owner in after.owners.items() if snap.leases.get(p, ("", 0))[0] != owner
        }
        if not unsettled:
            break
        if time.monotonic() > deadline:
            shown = ", ".join(f"{p} -> {m}" for p, m in list(unsettled.items())[:8])
            raise NatsOrderedError(
                f"group {group} did not settle within {timeout:g}s after generation "
                f"{after.generation}: partitions not yet claimed by their owner: {shown}"
            )
        await asyncio.sleep(0.1)
    return Rebalanced(
        stream,
        group,
        after.generation,
        moves(before, after),
        dict(after.owners),
        imbalance(before, weights, members) if weights and before else None,
        imbalance(after, weights, members) if weights else None,
        time.monotonic() - t0,
    )


async def partition_rates(nc: NATS, stream: str, window: float = 3600.0) -> dict[int, float]:
    """Messages per second stored in each partition over the last ``window`` seconds (what
    a rebalance by load weighs). Counted by the server: an ephemeral consumer per partition
    starting at ``now - window`` reports how many messages it has pending."""
    described = await describe(nc, stream)
    js = nc.jetstream()
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=window)

    async def rate(p: int) -> tuple[int, float]:
        info = await js.add_consumer(
            described.name,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_TIME,
                opt_start_time=since,  # nats-py sends it as RFC 3339 UTC
                ack_policy=api.AckPolicy.NONE,
                filter_subject=described.subject(p),
                mem_storage=True,
                inactive_threshold=5.0,
            ),
        )
        with contextlib.suppress(Exception):
            await js.delete_consumer(described.name, info.name or "")
        return p, (info.num_pending or 0) / window

    return dict(await asyncio.gather(*(rate(p) for p in range(described.partitions))))
