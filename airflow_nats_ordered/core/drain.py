"""How far behind a consumer group is, and waiting until it has caught up (drained).

A partition's *lag* is the number of its messages after the group's committed position
(``c.<n>`` in the group's state bucket). A group is *drained* up to a set of *marks*
(partition -> stream sequence) when every partition's committed position is at or past its
mark; by default the marks are the partitions' last sequences at the time of the call, so
"drained" means "everything published before I asked has been processed and committed".

:func:`wait_drained` watches the commit records with a KV watcher (the server pushes each
commit; nothing is polled), so an Airflow trigger can sit on it for hours at no cost. It
fails fast when a partition is blocked on a poison message (``poison="block"``), because
waiting longer cannot help, and it raises :class:`DrainTimeoutError` naming the partitions
still behind when ``timeout`` passes.

Stray messages (stored on subjects that are not partition subjects, see
:class:`.streams.Strays`) are never read by any worker, so a stream holding them is never
drained: :attr:`GroupLag.drained` is False and :func:`wait_drained` fails with
:class:`StrayMessagesError`, which says how to remove them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_PURGE

from .errors import ConfigError, NatsOrderedError
from .group import CommitRecord, GroupState, GroupStore, StreamRecreated
from .group_admin import live_members
from .streams import PartitionStats, Strays, describe, stray_messages, stream_contents

#: seconds between checks of what the server does not push: live members, the stream
CHECK_EVERY = 2.0


class DrainTimeoutError(NatsOrderedError):
    """The group did not reach its marks in time. ``behind`` maps each partition still
    behind to ``(committed, mark)``."""

    def __init__(self, message: str, behind: dict[int, tuple[int, int]]) -> None:
        super().__init__(message)
        self.behind = behind


class NoMembersError(NatsOrderedError):
    """No member of the group has been alive for the allowed time: nothing is consuming
    the group, so waiting longer cannot help until workers are started."""


class StrayMessagesError(NatsOrderedError):
    """The stream holds messages on subjects that are not partition subjects: no worker
    reads them, so waiting cannot drain them. ``strays`` says where they are."""

    def __init__(self, strays: Strays) -> None:
        super().__init__(strays.problem())
        self.strays = strays


class PartitionBlockedError(NatsOrderedError):
    """A partition is blocked on a poison message before reaching its mark: it will not
    drain until the handler is fixed (or the message is dealt with)."""

    def __init__(self, message: str, partition: int, reason: str) -> None:
        super().__init__(message)
        self.partition = partition
        self.reason = reason


def lag(last: int, committed: int, messages: int) -> int:
    """Messages of a partition after the committed position.

    An upper bound: stream sequences are shared by all partitions, so the count comes from
    the partition's own message count, never from ``last - committed`` alone."""
    if committed >= last:
        return 0
    return messages if committed == 0 else min(messages, last - committed)


@dataclass(frozen=True)
class PartitionLag:
    """One partition: last stream sequence, committed position, lag, blocked reason."""

    partition: int
    last: int
    committed: int
    messages: int
    blocked: str | None = None

    @property
    def lag(self) -> int:
        return lag(self.last, self.committed, self.messages)


@dataclass(frozen=True)
class GroupLag:
    """A group's lag over all partitions; ``drained`` when no partition is behind and the
    stream holds no stray messages (which no worker ever reads)."""

    stream: str
    group: str
    partitions: tuple[PartitionLag, ...]
    strays: Strays | None = None

    @property
    def total_lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    @property
    def drained(self) -> bool:
        return not self.strays and all(p.committed >= p.last for p in self.partitions)


def group_lag(
    stream: str,
    group: str,
    stats: Sequence[PartitionStats],
    state: GroupState,
    strays: Strays | None = None,
) -> GroupLag:
    """The lag of ``group`` from already-read partition stats and a group snapshot (and the
    stream's strays, read with the stats by :func:`.streams.stream_contents`)."""
    parts = []
    for s in stats:
        c = state.commits.get(s.partition)
        parts.append(
            PartitionLag(
                s.partition,
                s.last_seq,
                c.seq if c else 0,
                s.messages,
                state.blocked.get(s.partition),
            )
        )
    return GroupLag(stream, group, tuple(parts), strays)


async def read_lag(nc: NATS, stream: str, group: str) -> GroupLag:
    """Read a group's lag now, with the stream's strays (raises NatsOrderedError if the
    group has no state yet)."""
    described = await describe(nc, stream)
    store = await GroupStore.attach(nc, stream, group)
    contents = await stream_contents(nc, described)
    return group_lag(stream, group, contents.partitions, await store.snapshot(), contents.strays)


@dataclass(frozen=True)
class DrainProgress:
    """Where a wait stands: each awaited partition's committed position and mark."""

    marks: Mapping[int, int]
    committed: Mapping[int, int]
    elapsed: float

    @property
    def behind(self) -> dict[int, tuple[int, int]]:
        """Partitions not yet at their mark: ``partition -> (committed, mark)``."""
        return {
            p: (self.committed.get(p, 0), m)
            for p, m in sorted(self.marks.items())
            if self.committed.get(p, 0) < m
        }

    @property
    def done(self) -> bool:
        return not self.behind


async def wait_drained(
    nc: NATS,
    stream: str,
    group: str,
    *,
    marks: Mapping[int, int] | None = None,
    timeout: float | None = None,
    no_members_timeout: float | None = None,
    on_progress: Callable[[DrainProgress], None] | None = None,
) -> DrainProgress:
    """Return once every partition's committed position has reached its mark.

    ``marks`` maps partition -> stream sequence (e.g. the high-water marks a publisher
    reported); partitions left out are not waited for. By default the marks are every
    partition's last sequence now. ``timeout`` in seconds (None: no limit). ``on_progress``
    is called with the state once the current commits are known and after every commit.

    Raises :class:`StrayMessagesError` when the stream holds stray messages (checked at the
    start, and every :data:`CHECK_EVERY` seconds while the stream still accepts them),
    :class:`PartitionBlockedError` as soon as a partition still short of its mark is
    blocked on a poison message, :class:`DrainTimeoutError` when ``timeout`` passes,
    :class:`NoMembersError` when ``no_members_timeout`` is set and no member of the group has
    been alive for that long (membership is checked every :data:`CHECK_EVERY` seconds: an
    expired heartbeat sends no event), ``StreamRecreated`` when the stream was deleted and
    created again (the group's positions no longer mean anything), and NatsOrderedError if
    the group has no state yet (no worker ever joined it).
    """
    t0 = time.monotonic()
    described = await describe(nc, stream)
    store = await GroupStore.attach(nc, stream, group)
    contents = await stream_contents(nc, described)
    if contents.strays:
        raise StrayMessagesError(contents.strays)
    if marks is None:
        marks = {s.partition: s.last_seq for s in contents.partitions}
    else:
        marks = {int(p): int(m) for p, m in marks.items()}
        wrong = sorted(p for p in marks if not 0 <= p < described.partitions)
        if wrong:
            raise ConfigError(
                f"marks name partitions {wrong} but stream {stream} has partitions 0 to "
                f"{described.partitions - 1}; pass the marks the publisher reported for it"
            )
    committed: dict[int, int] = {}
    commit_rev: dict[int, int] = {}  # revision of each partition's latest commit record
    blocked: dict[int, tuple[str, int]] = {}  # reason, revision of the marker
    members_seen = time.monotonic()  # the no-members countdown starts with the wait
    next_check = 0.0
    # the watcher first delivers each key's current value, then a None marker, then every
    # change as the server stores it
    watcher = await store.state.watch(">")
    caught_up = False
    try:
        while True:
            if caught_up:
                progress = DrainProgress(marks, dict(committed), time.monotonic() - t0)
                behind = progress.behind
                # a marker counts while no commit record came after it: a newer grant or the
                # hand-over commit means the next owner is trying again
                stuck = sorted(
                    p for p in set(blocked) & set(behind) if blocked[p][1] > commit_rev.get(p, 0)
                )
                if stuck:
                    p = stuck[0]
                    raise PartitionBlockedError(
                        f"partition {p} of stream {stream} is blocked in group {group} before "
                        f"reaching sequence {marks[p]} (committed {committed.get(p, 0)}): "
                        f"{blocked[p][0]}. Fix the handler and restart the group's workers (the "
                        "next owner retries the message), or run them with the dead-letter "
                        "policy to set the message aside",
                        p,
                        blocked[p][0],
                    )
                if on_progress is not None:
                    on_progress(progress)
                if not behind:
                    return progress
            now = time.monotonic()
            wait = None if timeout is None else timeout - (now - t0)
            if wait is not None and wait <= 0:
                raise _timeout_error(stream, group, timeout or 0.0, marks, committed)
            if now >= next_check:
                next_check = now + CHECK_EVERY
                await store.check_stream()
                if not described.explicit_subjects:  # a wildcard stream may take new strays
                    strays = await stray_messages(nc, described)
                    if strays:
                        raise StrayMessagesError(strays)
                if caught_up:  # do not trust one watcher forever: re-read what is behind
                    for p in DrainProgress(marks, committed, 0.0).behind:
                        rec, rev = await store.read_commit(p)
                        if rec is not None and rev > commit_rev.get(p, 0):
                            committed[p], commit_rev[p] = rec.seq, rev
                if no_members_timeout is not None:
                    if await live_members(nc, stream, group):
                        members_seen = now
                    elif now - members_seen > no_members_timeout:
                        raise _no_members_error(stream, group, no_members_timeout, marks, committed)
            step = CHECK_EVERY if wait is None else min(wait, CHECK_EVERY)
            try:
                entry = await watcher.updates(timeout=max(0.05, step))
            except nats.errors.TimeoutError:
                continue
            if entry is None:
                caught_up = True
                continue
            deleted = entry.operation in (KV_DEL, KV_PURGE)
            if entry.key.startswith("c."):
                p = int(entry.key[2:])
                if entry.revision and entry.revision < commit_rev.get(p, 0):
                    continue  # older than what a re-read found
                committed[p] = 0 if deleted else CommitRecord.from_json(entry.value).seq
                commit_rev[p] = entry.revision or 0
            elif entry.key == "stream" and not deleted:
                recorded = json.loads(entry.value or b"{}").get("created", "")
                if recorded and described.created and recorded != described.created:
                    raise StreamRecreated(store._recreated_message(recorded, described.created))
            elif entry.key.startswith("blocked."):
                p = int(entry.key[len("blocked.") :])
                if deleted:
                    blocked.pop(p, None)
                else:
                    reason = (entry.value or b"").decode(errors="replace")
                    blocked[p] = (reason, entry.revision or 0)
            else:
                continue
    finally:
        await asyncio.shield(watcher.stop())


def _no_members_error(
    stream: str,
    group: str,
    after: float,
    marks: Mapping[int, int],
    committed: Mapping[int, int],
) -> NoMembersError:
    behind = len(DrainProgress(marks, committed, 0.0).behind)
    return NoMembersError(
        f"no worker pool is consuming group {group} of stream {stream}: no member has been "
        f"alive for {after:g}s while {behind} partition(s) are behind their mark. Start the "
        f"workers (`nats-ordered worker --stream {stream} --group {group} --handler ...`), "
        "then retry"
    )


def _timeout_error(
    stream: str,
    group: str,
    timeout: float,
    marks: Mapping[int, int],
    committed: Mapping[int, int],
) -> DrainTimeoutError:
    behind = DrainProgress(marks, committed, timeout).behind
    shown = ", ".join(f"{p} at {c} of {m}" for p, (c, m) in list(behind.items())[:5])
    more = f" and {len(behind) - 5} more" if len(behind) > 5 else ""
    return DrainTimeoutError(
        f"group {group} of stream {stream} did not drain within {timeout:g}s: "
        f"{len(behind)} partition(s) behind their mark (partition {shown}{more}). Check that "
        f"its workers are running and making progress (`nats-ordered status --stream {stream} "
        f"--group {group}`), or pass a longer timeout",
        behind,
    )
