"""How far behind a consumer group is now, and waiting until it has caught up (drained).

A partition's *lag* (:mod:`..group.lag`) is the number of its records after the group's
committed position (``c.<n>`` in the group's state bucket; for a global-order reader's
group, the partition's stream sequence in the reader's position, key ``global``), counted
exactly by the server; :func:`read_lag` reads it now. A group is *drained* up to a set of
*marks* (:mod:`.marks`: partition -> stream sequence) when every partition's committed
position is at or past its mark; by default the marks are the partitions' last sequences at
the time of the call, so "drained" means "everything published before I asked has been
processed and committed".

:func:`wait_drained` watches the commit records with a KV watcher (the server pushes each
commit; nothing is polled), so an Airflow trigger can sit on it for hours at no cost. It
fails fast (:mod:`.drain_errors`) when a partition is blocked on a poison message
(``poison="block"``), because waiting longer cannot help, when nobody consumes the group (no
live member for ``no_members_timeout``, :data:`DEFAULT_NO_MEMBERS_TIMEOUT` by default), and
it raises :class:`~.drain_errors.DrainTimeoutError` naming the partitions still behind when
``timeout`` passes. A group that has no state yet (no worker has joined it: the workers were
started a moment ago, or are about to be) is waited for, within the same two bounds.

Stray messages (stored on subjects that are not partition subjects, see
:class:`..stream.strays.Strays`) are never read by any worker, so a stream holding them is
never drained: :attr:`..group.lag.GroupLag.drained` is False and :func:`wait_drained` fails
with :class:`StrayMessagesError`, which says how to remove them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_PURGE

from airflow_nats_ordered.core.admin.drain_errors import (
    NoGroupStateError,
    PartitionBlockedError,
    RepartitionUnfinishedError,
    StrayMessagesError,
    no_members_error,
    timeout_error,
)
from airflow_nats_ordered.core.admin.marks import DrainProgress, marks_to_wait, recorded_switch
from airflow_nats_ordered.core.admin.membership import group_exists, live_members, reader_alive
from airflow_nats_ordered.core.group.commits import CommitRecord
from airflow_nats_ordered.core.group.global_position import POSITION_KEY, GlobalPosition
from airflow_nats_ordered.core.group.lag import GroupLag, read_group_lag
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.group.stream_identity import StreamRecreated
from airflow_nats_ordered.core.stream.kv import latest_entry
from airflow_nats_ordered.core.stream.layout import (
    GROUP_EPOCH_KEY,
    Layout,
    group_epoch_of,
    key_partition,
    pending_switch_problem,
)
from airflow_nats_ordered.core.stream.partitioned import (
    PartitionedStream,
    describe,
    stray_messages,
    stream_contents,
)

#: seconds between checks of what the server does not push: live members, the stream
CHECK_EVERY = 2.0

#: seconds between two looks for the buckets of a group that has no state yet
GROUP_CHECK_EVERY = 0.5

#: default ``no_members_timeout`` of :func:`wait_drained` (and of ``status --wait-drained``
#: and the drain sensor): 60 s is long enough for a supervised member to come back (a dead
#: member's heartbeat lasts one lease TTL, 5 s by default, and ``nats-ordered pool`` restarts
#: a member after 1 s, doubling per exit in a row: five crashes in a row are back within
#: ~36 s) and for the first member of a just-started pool to create the group, and short
#: enough that a wait on a group nobody consumes fails within a minute instead of hanging
DEFAULT_NO_MEMBERS_TIMEOUT = 60.0


async def read_lag(nc: NATS, stream: str, group: str) -> GroupLag:
    """Read a group's lag now (:func:`..group.lag.read_group_lag`), with the stream's strays
    (raises :class:`NoGroupStateError`, a NatsOrderedError, if the group has no state yet)."""
    described = await describe(nc, stream)
    if not await group_exists(nc, stream, group):
        raise NoGroupStateError(stream, group)
    store = await GroupStore.attach(nc, stream, group)
    return await read_group_lag(nc, described, store, await store.snapshot())


async def wait_drained(
    nc: NATS,
    stream: str,
    group: str,
    *,
    marks: Mapping[int, int] | None = None,
    timeout: float | None = None,
    no_members_timeout: float | None = DEFAULT_NO_MEMBERS_TIMEOUT,
    on_progress: Callable[[DrainProgress], None] | None = None,
) -> DrainProgress:
    """Return once every partition's committed position has reached its mark.

    ``marks`` maps partition -> stream sequence (e.g. the high-water marks a publisher
    reported); partitions left out are not waited for. By default the marks are every
    partition's last sequence now. ``timeout`` in seconds (None: no limit). ``on_progress``
    is called with the state once the current commits are known and after every commit
    (and, while the group has no state yet, every :data:`GROUP_CHECK_EVERY` seconds with
    ``group_missing`` set).

    ``no_members_timeout`` (seconds, default :data:`DEFAULT_NO_MEMBERS_TIMEOUT`; None: wait
    anyway) bounds how long the group may go without a live member, counted from the start
    of the call: a wait on a group nobody consumes ends instead of hanging. A group that has
    no state yet (no worker has joined it) is waited for, not refused: workers started just
    before (or after) the call create it; the wait for it ends within the same bounds.
    When every mark is already reached (e.g. marks at 0) it returns at once, state or not.

    Raises :class:`StrayMessagesError` when the stream holds stray messages (checked at the
    start, and every :data:`CHECK_EVERY` seconds while the stream still accepts them),
    :class:`PartitionBlockedError` as soon as a partition still short of its mark is
    blocked on a poison message, :class:`~.drain_errors.DrainTimeoutError` when ``timeout`` passes,
    :class:`~.drain_errors.NoMembersError` when no member of the group has been alive for
    ``no_members_timeout`` seconds, or the group still has no state then (membership is
    checked every :data:`CHECK_EVERY` seconds: an expired heartbeat sends no event),
    ``StreamRecreated`` when the stream was deleted and created again (the group's positions
    no longer mean anything), and :class:`~..errors.StreamNotFoundError` if the stream does
    not exist.

    While the stream's repartition has not recorded its switch point (running, or
    interrupted), it never returns: no group moves past the closed layout, and which marks
    are of it, or whether all its records are stored, is not known yet. The marks are
    compared once the switch point is recorded (the stream is read every
    :data:`CHECK_EVERY` seconds meanwhile); it raises :class:`RepartitionUnfinishedError`,
    naming the command that completes the repartition, when that has not happened within
    ``no_members_timeout`` seconds of the call, and the :class:`~.drain_errors.DrainTimeoutError` at
    ``timeout`` says the same. If the run that records it also repartitioned again (the
    stream is past the layout the wait began on), the marks are all of closed layouts: the
    wait goes on until the group reads the stream's current layout.
    """
    t0 = time.monotonic()
    described = await describe(nc, stream)
    contents = await stream_contents(nc, described)
    if contents.strays:
        raise StrayMessagesError(contents.strays)
    given = marks if marks is not None else {s.partition: s.last_seq for s in contents.partitions}
    # a repartitioned stream: the group must also have finished every earlier layout, whose
    # records are all at or below the last switch point (a mark there is covered by that).
    # While a switch point is pending, which marks are of the closed layout is not known
    # (nor whether all its records are stored): the marks wait until it is recorded
    need_epoch = described.current_epoch
    unfinished = described.pending_switch
    marks = {}
    if unfinished is None:
        marks = marks_to_wait(
            given,
            partitions=described.partitions,
            switch_seq=recorded_switch(described),
            stream=stream,
        )
    group_epoch = described.oldest_epoch

    def waiting() -> int | None:
        return need_epoch if group_epoch < need_epoch else None

    def pending() -> int | None:
        return None if unfinished is None else unfinished.epoch

    if not await group_exists(nc, stream, group):
        nothing = DrainProgress(
            marks,
            {},
            time.monotonic() - t0,
            group_missing=True,
            waiting_epoch=waiting(),
            pending_switch=pending(),
        )
        if nothing.done:
            if on_progress is not None:
                on_progress(nothing)
            return nothing
        await _wait_for_group(
            nc, described, group, marks, t0, timeout, no_members_timeout, on_progress
        )
    store = await GroupStore.attach(nc, stream, group)
    store.epoch = need_epoch  # the commit records of the stream's current layout
    committed: dict[int, int] = {}
    commit_rev: dict[int, int] = {}  # revision of each partition's latest commit record
    blocked: dict[int, tuple[str, int]] = {}  # reason, revision of the marker
    members_seen = t0  # the no-members countdown starts with the wait
    next_check = 0.0
    # the watcher first delivers each key's current value, then a None marker, then every
    # change as the server stores it
    watcher = await store.state.watch(">")
    caught_up = False
    # a global-order reader's group: its position (key ``global``) holds every partition's
    # stream sequence; a partition with its own commit record goes by that record
    global_rev = 0

    def take_global(value: bytes | None) -> None:
        seqs = GlobalPosition.from_json(value).seqs if value else {}
        for p in set(marks or ()) | set(seqs):
            if p not in commit_rev:
                committed[p] = seqs.get(p, 0)

    try:
        while True:
            if caught_up:
                progress = DrainProgress(
                    marks,
                    dict(committed),
                    time.monotonic() - t0,
                    waiting_epoch=waiting(),
                    pending_switch=pending(),
                )
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
                if progress.done:
                    return progress
            now = time.monotonic()
            wait = None if timeout is None else timeout - (now - t0)
            if wait is not None and wait <= 0:
                raise timeout_error(
                    stream,
                    group,
                    timeout or 0.0,
                    marks,
                    committed,
                    waiting_epoch=waiting(),
                    unfinished=_unfinished_problem(described, unfinished),
                )
            if now >= next_check:
                next_check = now + CHECK_EVERY
                await store.check_stream()
                if unfinished is not None:  # recorded since? then the marks are known
                    now_described = await describe(nc, stream)
                    unfinished = now_described.pending_switch
                    if unfinished is None and now_described.current_epoch != need_epoch:
                        # the run that recorded it repartitioned again: the layout this wait
                        # began on is closed too, and every mark given is at or below the
                        # newest switch point, met once the group reads the current layout
                        # (it moves only after applying every earlier one). The wait goes on
                        # there, with that layout's commit records, from a new watcher
                        described, need_epoch = now_described, now_described.current_epoch
                        store.epoch = need_epoch
                        group_epoch = described.oldest_epoch
                        committed.clear()
                        commit_rev.clear()
                        blocked.clear()
                        global_rev = 0
                        await asyncio.shield(watcher.stop())
                        watcher = await store.state.watch(">")
                        caught_up = False
                    if unfinished is None:
                        marks = marks_to_wait(
                            given,
                            partitions=now_described.at_epoch(need_epoch).partitions,
                            switch_seq=recorded_switch(now_described),
                            stream=stream,
                        )
                    elif no_members_timeout is not None and now - t0 > no_members_timeout:
                        raise RepartitionUnfinishedError(
                            f"group {group} of stream {stream} cannot drain: "
                            + pending_switch_problem(
                                stream,
                                now_described.current_partitions,
                                now_described.current_epoch,
                                unfinished.epoch,
                            )
                            + f" (still so after {no_members_timeout:g}s of this wait)",
                            unfinished.epoch,
                        )
                if not described.explicit_subjects:  # a wildcard stream may take new strays
                    strays = await stray_messages(nc, described)
                    if strays:
                        raise StrayMessagesError(strays)
                if caught_up:  # do not trust one watcher forever: re-read what is behind
                    for p in DrainProgress(marks, committed, 0.0).behind:
                        rec, rev = await store.read_commit(p)
                        if rec is not None and rev > commit_rev.get(p, 0):
                            committed[p], commit_rev[p] = rec.seq, rev
                    if waiting() is not None:
                        found = await latest_entry(nc, store.cfg.state_bucket, GROUP_EPOCH_KEY)
                        group_epoch = group_epoch_of(found and found[0], described.oldest_epoch)
                    if global_rev:
                        found = await latest_entry(nc, store.cfg.state_bucket, POSITION_KEY)
                        if found is not None and found[1] > global_rev:
                            take_global(found[0])
                            global_rev = found[1]
                if no_members_timeout is not None:
                    if await live_members(nc, stream, group) or await reader_alive(store):
                        members_seen = now
                    elif now - members_seen > no_members_timeout:
                        raise no_members_error(
                            stream,
                            group,
                            no_members_timeout,
                            DrainProgress(marks, committed, 0.0).behind,
                            waiting_epoch=waiting(),
                        )
            step = CHECK_EVERY if wait is None else min(wait, CHECK_EVERY)
            try:
                entry = await watcher.updates(timeout=max(0.05, step))
            except nats.errors.TimeoutError:
                continue
            if entry is None:
                caught_up = True
                continue
            deleted = entry.operation in (KV_DEL, KV_PURGE)
            if entry.key == GROUP_EPOCH_KEY:
                value = None if deleted else entry.value
                group_epoch = group_epoch_of(value, described.oldest_epoch)
            elif (cp := key_partition(entry.key, need_epoch, "c")) is not None:
                if entry.revision and entry.revision < commit_rev.get(cp, 0):
                    continue  # older than what a re-read found
                committed[cp] = 0 if deleted else CommitRecord.from_json(entry.value).seq
                commit_rev[cp] = entry.revision or 0
            elif entry.key == POSITION_KEY:
                if entry.revision and entry.revision < global_rev:
                    continue  # older than what a re-read found
                take_global(None if deleted else entry.value)
                global_rev = entry.revision or 0
            elif entry.key == "stream" and not deleted:
                recorded = json.loads(entry.value or b"{}").get("created", "")
                if recorded and described.created and recorded != described.created:
                    raise StreamRecreated(store.recreated_message(recorded, described.created))
            elif (bp := key_partition(entry.key, need_epoch, "blocked")) is not None:
                if deleted:
                    blocked.pop(bp, None)
                else:
                    reason = (entry.value or b"").decode(errors="replace")
                    blocked[bp] = (reason, entry.revision or 0)
            else:
                continue
    finally:
        await asyncio.shield(watcher.stop())


async def _wait_for_group(
    nc: NATS,
    described: PartitionedStream,
    group: str,
    marks: Mapping[int, int],
    t0: float,
    timeout: float | None,
    no_members_timeout: float | None,
    on_progress: Callable[[DrainProgress], None] | None,
) -> None:
    """Return once the group has state (its first member created its buckets); raise
    :class:`~.drain_errors.DrainTimeoutError` at ``timeout`` and
    :class:`~.drain_errors.NoMembersError` at ``no_members_timeout`` (both from ``t0``),
    :class:`StrayMessagesError` when a stray lands on a wildcard stream meanwhile. Polls
    every :data:`GROUP_CHECK_EVERY` seconds: bucket creation sends no event a client could
    watch without the buckets."""
    stream = described.name
    next_check = time.monotonic() + CHECK_EVERY
    while not await group_exists(nc, stream, group):
        now = time.monotonic()
        elapsed = now - t0
        if timeout is not None and elapsed >= timeout:
            raise timeout_error(stream, group, timeout, marks, {}, group_missing=True)
        if no_members_timeout is not None and elapsed > no_members_timeout:
            raise no_members_error(
                stream,
                group,
                no_members_timeout,
                DrainProgress(marks, {}, 0.0).behind,
                group_missing=True,
            )
        if now >= next_check:
            next_check = now + CHECK_EVERY
            if not described.explicit_subjects:  # a wildcard stream may take new strays
                strays = await stray_messages(nc, described)
                if strays:
                    raise StrayMessagesError(strays)
        if on_progress is not None:
            on_progress(DrainProgress(marks, {}, elapsed, group_missing=True))
        step = GROUP_CHECK_EVERY
        for bound in (timeout, no_members_timeout):
            if bound is not None:
                step = min(step, max(0.05, bound - elapsed))
        await asyncio.sleep(step)


def _unfinished_problem(described: PartitionedStream, unfinished: Layout | None) -> str | None:
    """What a wait says while ``unfinished`` (a layout of ``described``) is pending."""
    if unfinished is None:
        return None
    return pending_switch_problem(
        described.name, described.current_partitions, described.current_epoch, unfinished.epoch
    )
