"""Changing a stream's partition count without breaking any key's order (issue 18 part 2).

A repartition to ``N`` takes the stream from layout epoch ``k-1`` to ``k`` (see
:mod:`.layout`) in two stream configuration updates, each of which the server applies
whole or not at all:

1. **switch**: the stream's subjects become epoch ``k``'s (``<prefix>.p.e<k>-<n>``) and its
   metadata says epoch ``k``, ``N`` partitions and the earlier layouts, the closed one
   marked ``pending`` (its switch point is not known yet). From this update on the server
   refuses every publish routed by an earlier layout (no stream takes those subjects any
   more), so a publisher that started before it fails with the stream's new layout named
   instead of routing a key to a partition its readers do not expect.
2. **record**: the closed layout's *switch point* is written: the sequence of its last
   record. It is exact, not an estimate: publishes to the old subjects that the server took
   before update 1 may still sit in the stream's ingest queue when update 1 is answered
   (users measured ~500 stored after a switch point read right after the update). So the
   switch point is read only after a probe sent to a subject the stream takes came back:
   a publish that expects the last sequence 2^63-1 is refused without being stored, in
   the stream's ingest order, and its refusal names the stream's last sequence L including
   everything queued before it; once the stream holds L, the old subjects hold every
   record they will ever hold. The switch point is the largest last sequence of the old
   subjects, read twice with a probe in between until both reads agree.

While the closed layout is ``pending``, groups stay on it (:mod:`..worker.epochs`): no
record of the new layout is handed out before the switch point is known.

**Crash safety.** Every step is idempotent and the stream's metadata is the journal: a run
killed at any point (see :data:`CRASH_POINTS`) leaves either the old layout (nothing
done), or the new subjects with a pending switch point, or the finished switch. The next
``repartition`` of the stream (with the same count, or any count) completes an interrupted
one first, to the same state an uninterrupted run leaves, and says so
(:attr:`RepartitionResult.action` ``"completed"``); run again after it finished, it
reports ``"unchanged"``. It also completes a stream whose subjects are another layout's
than its metadata's (which :func:`~.partitioned.describe` refuses for every other command).

One repartition of a stream runs at a time: a lock key (``lock`` in the KV bucket
``nor_<stream>_repartition``, expiring :data:`LOCK_TTL` seconds after it was taken, so a
crashed run does not hold it forever) refuses a second one. A run on the same host finds a
lock whose process is gone (killed) and takes it over at once.

Records of the closed layout stay in the stream and stay readable (consumers may filter on
subjects the stream no longer takes; checked on nats-server 2.15). A consumer group
finishes them first: its workers process the old epoch's partitions exactly as before, and
the group moves to the new epoch only once every old partition's commit covers its last
record (murmur3 sends the keys of any old partition to any new one, so the barrier is over
all old partitions). See :mod:`..worker.epochs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError, BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import (
    ConfigError,
    NatsOrderedError,
    StreamConflictError,
    StreamNotFoundError,
)
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.layout import (
    META_EPOCH,
    META_LAYOUTS,
    Layout,
    is_partition_subject,
    layouts_json,
    repartitioned_message,
    subjects_layout,
)
from airflow_nats_ordered.core.stream.partitioned import (
    MAX_PARTITIONS,
    META_PARTITIONS,
    PROVISION_TIMEOUT,
    PartitionedStream,
    describe,
    stream_contents,
)

#: seconds a repartition's lock lives: longer than the update may take
LOCK_TTL = 300.0

#: Testing hook: a run whose environment sets this to one of :data:`CRASH_POINTS` kills
#: itself with SIGKILL there (the tests stop a ``nats-ordered repartition`` process at each
#: step this way, then check that the next run completes it).
CRASH_ENV = "NATS_ORDERED_REPARTITION_CRASH_AT"
#: the steps of a run, in order: the lock taken (nothing changed yet); the stream's
#: subjects switched (update 1; switch point pending); the switch point read (not yet
#: written); the switch point recorded (update 2; the lock not yet released)
CRASH_POINTS = ("locked", "subjects-switched", "switch-read", "switch-recorded")

#: the probe's expected last sequence: no stream reaches it, so the probe is never stored
_PROBE_EXPECT = str(2**63 - 1)
_LAST_SEQ_RE = re.compile(r"wrong last sequence: (\d+)")
#: seconds the switch point waits for the stream to hold what it had queued
SETTLE_TIMEOUT = 60.0


class RepartitionRunning(NatsOrderedError):
    """Another repartition of the stream holds the lock."""


@dataclass(frozen=True)
class RepartitionResult:
    """What :func:`repartition` did: the stream went from ``previous_partitions`` (epoch
    ``previous_epoch``) to ``partitions`` in ``epoch``; records of the earlier layout all
    have sequences at or below ``switch_seq``, those of the new one above it. ``action``:
    ``"repartitioned"`` (this run did it all), ``"completed"`` (it completed an interrupted
    run's switch, as that run would have) or ``"unchanged"`` (it had been done already)."""

    stream: str
    previous_partitions: int
    previous_epoch: int
    partitions: int
    epoch: int
    switch_seq: int
    subjects: str
    action: str = "repartitioned"

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "action": self.action,
            "previous_partitions": self.previous_partitions,
            "previous_epoch": self.previous_epoch,
            "partitions": self.partitions,
            "epoch": self.epoch,
            "switch_seq": self.switch_seq,
            "subjects": self.subjects,
        }


def lock_bucket(stream: str) -> str:
    return f"nor_{stream}_repartition"


def _crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def interrupted(s: PartitionedStream) -> bool:
    """A repartition of ``s`` is not finished: its switch point is pending, or its
    partition subjects are not its metadata's layout."""
    subjects = s.config.subjects or []
    if f"{s.prefix}.p.*" in subjects:
        return s.pending_switch is not None
    taken = sorted(x for x in subjects if is_partition_subject(s.prefix, x))
    return s.pending_switch is not None or taken != sorted(s.layout.subjects)


def _finished(s: PartitionedStream, action: str) -> RepartitionResult:
    closed = s.layouts[-1]
    new = s.at_epoch(s.current_epoch)
    return RepartitionResult(
        s.name,
        closed.partitions,
        closed.epoch,
        new.partitions,
        new.epoch,
        closed.switch_seq,
        f"{new.subject(0)} to {new.subject(new.partitions - 1)}",
        action,
    )


async def _refuse_global_order(nc: NATS, stream: str) -> None:
    """ConfigError for a stream published in global order (its watermark bucket exists):
    its watermarks are per partition of its layout, and its global-order readers merge
    that layout's partitions: neither follows a switch yet."""
    bucket = watermark_bucket(stream)
    try:
        await jetstream(nc).key_value(bucket)
    except BucketNotFoundError:
        return
    raise ConfigError(
        f"stream {stream} is published in global order (its watermarks are in KV bucket "
        f"{bucket}), and the global-order publisher and reader follow one partition layout: "
        "repartitioning it would stall or misorder its global-order readers. If nothing "
        f"publishes or reads {stream} in global order any more, delete that bucket "
        f"(`nats kv del {bucket}`) and repartition again; otherwise keep its partition count"
    )


async def repartition(
    nc: NATS,
    stream: str,
    partitions: int,
    *,
    progress: Callable[[str], None] | None = None,
) -> RepartitionResult:
    """Switch ``stream`` to ``partitions`` partitions at one recorded point (see the module),
    completing first a repartition of it that was interrupted.

    Refuses (ConfigError) a count outside 1..4096 or equal to the count of a stream never
    repartitioned, a stream that still takes the wildcard ``<prefix>.p.*`` (narrow it with
    ``provision`` first), a stream published in global order (its watermarks and its
    global-order readers follow one partition layout); StreamNotFoundError for an unknown
    stream; :class:`RepartitionRunning` while another repartition of it runs. Asked for the
    count a finished repartition already gave the stream, it changes nothing and returns
    ``action="unchanged"``. ``progress`` gets one line per step."""
    say = progress or (lambda _line: None)
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise ConfigError(f"partitions must be an integer, got {partitions!r}")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigError(f"partitions must be from 1 to {MAX_PARTITIONS}, got {partitions}")
    current = await describe(nc, stream, check_layout=False)
    _refuse_unchangeable(current, partitions)
    await _refuse_global_order(nc, stream)
    kv = await _lock_kv(nc, stream)
    rev = await _take_lock(kv, stream, partitions, say)
    try:
        _crash_point("locked")
        return await _switch(nc, stream, partitions, say)
    finally:
        with contextlib.suppress(Exception):  # else it expires after LOCK_TTL
            await kv.delete("lock", last=rev)


def _refuse_unchangeable(current: PartitionedStream, partitions: int) -> None:
    stream = current.name
    if f"{current.prefix}.p.*" in (current.config.subjects or []):
        raise ConfigError(
            f"stream {stream} still takes the wildcard subject {current.prefix}.p.*; narrow it "
            f"to its partition subjects first: `nats-ordered provision --stream {stream} "
            f"--partitions {current.partitions}`"
        )
    if partitions == current.partitions and not current.layouts and not interrupted(current):
        raise ConfigError(
            f"stream {stream} already has {partitions} partitions (epoch {current.epoch}); "
            "nothing to change: pass another partition count"
        )


async def _switch(
    nc: NATS, stream: str, partitions: int, say: Callable[[str], None]
) -> RepartitionResult:
    current = await describe(nc, stream, check_layout=False)  # again, under the lock
    _refuse_unchangeable(current, partitions)
    if interrupted(current):
        current = await _complete(nc, current, say)
        if partitions == current.partitions:
            return _finished(current, "completed")
    elif partitions == current.partitions:
        say(
            f"stream {stream} already has {partitions} partitions (epoch {current.epoch}); "
            "its repartition is complete"
        )
        return _finished(current, "unchanged")
    closed = Layout(current.epoch, current.partitions, current.prefix, 0, pending=True)
    new = Layout(current.epoch + 1, partitions, current.prefix)
    say(
        f"stream {stream}: closing layout epoch {closed.epoch} ({closed.partitions} partitions, "
        f"{closed.subject(0)} ...); opening epoch {new.epoch} ({new.partitions} partitions, "
        f"{new.subject(0)} ...)"
    )
    await _update(nc, current, new, [*current.layouts, closed])
    say(f"the server now refuses publishes routed by epoch {closed.epoch}'s layout")
    _crash_point("subjects-switched")
    switched = await describe(nc, stream, check_layout=False)
    return _finished(await _record_switch(nc, switched, say), "repartitioned")


async def _complete(
    nc: NATS, current: PartitionedStream, say: Callable[[str], None]
) -> PartitionedStream:
    """Finish the interrupted repartition of ``current`` (its metadata names the new
    layout): its subjects become that layout's if they are not, then the switch point is
    recorded. Returns the stream as it is afterwards."""
    stream, prefix = current.name, current.prefix
    new = current.at_epoch(current.current_epoch).layout
    layouts = list(current.layouts)
    taken = sorted(x for x in current.config.subjects or [] if is_partition_subject(prefix, x))
    if taken != sorted(new.subjects):
        shape = subjects_layout(prefix, taken)
        if layouts and layouts[-1].pending:
            closed = layouts[-1]
            if shape is not None and shape != (closed.epoch, closed.partitions):
                raise _cannot_complete(current, taken)
        elif (
            shape is not None
            and shape[0] < new.epoch
            and all(lay.epoch < shape[0] for lay in layouts)
        ):
            # the closed layout was never recorded: the subjects say which it was
            layouts.append(Layout(shape[0], shape[1], prefix, 0, pending=True))
        else:
            raise _cannot_complete(current, taken)
        say(
            f"completing the interrupted repartition of stream {stream}: its subjects become "
            f"layout epoch {new.epoch}'s ({new.subject(0)} to "
            f"{new.subject(new.partitions - 1)}), as its metadata says"
        )
        await _update(nc, current, new, layouts)
        _crash_point("subjects-switched")
        current = await describe(nc, stream, check_layout=False)
    else:
        closed = layouts[-1]
        say(
            f"completing the interrupted repartition of stream {stream} to {new.partitions} "
            f"partitions (epoch {new.epoch}): its subjects were switched, its switch point "
            "was not recorded"
        )
    return await _record_switch(nc, current, say)


def _cannot_complete(current: PartitionedStream, taken: list[str]) -> ConfigError:
    return ConfigError(
        f"stream {current.name}'s metadata says {current.partitions} partitions in layout "
        f"epoch {current.current_epoch} with earlier layouts "
        f"{layouts_json(current.layouts)}, but it takes {len(taken)} partition subjects "
        f"({', '.join(taken[:4])}{' ...' * (len(taken) > 4)}) that are no earlier layout "
        "this command can close. Set the stream's subjects by hand to the layout its records "
        f"were published by (`nats stream edit {current.name} --subjects ...`) and run it again"
    )


async def _update(nc: NATS, current: PartitionedStream, new: Layout, layouts: list[Layout]) -> None:
    """One stream update: subjects ``new``'s, metadata ``new`` with earlier ``layouts``."""
    stream = current.name
    cfg = current.config
    cfg.subjects = new.subjects
    meta = dict(cfg.metadata or {})
    meta.update(
        {
            META_PARTITIONS: str(new.partitions),
            META_EPOCH: str(new.epoch),
            META_LAYOUTS: layouts_json(layouts),
        }
    )
    cfg.metadata = meta
    size = len(json.dumps(cfg.as_dict()).encode())
    if nc.max_payload and size > nc.max_payload:
        raise ConfigError(
            f"stream {stream}'s configuration with {new.partitions} partition subjects is "
            f"{size} bytes, more than the server's max_payload ({nc.max_payload}): use fewer "
            "partitions"
        )
    try:
        await jetstream(nc, timeout=PROVISION_TIMEOUT).update_stream(cfg)
    except APIError as exc:
        raise StreamConflictError(
            f"cannot repartition stream {stream}: the server refused the update: {exc.description}"
        ) from exc


async def _record_switch(
    nc: NATS, current: PartitionedStream, say: Callable[[str], None]
) -> PartitionedStream:
    """Write the pending layout's exact switch point (update 2); the stream afterwards."""
    pending = current.pending_switch
    if pending is None:
        return current
    switch = await settled_switch_point(nc, current, pending)
    say(f"switch point of epoch {pending.epoch}: seq {switch} (its last record)")
    _crash_point("switch-read")
    info = await jetstream(nc).stream_info(current.name)
    cfg = info.config
    meta = dict(cfg.metadata or {})
    recorded = [
        dataclasses.replace(lay, switch_seq=switch, pending=False)
        if lay.epoch == pending.epoch
        else lay
        for lay in current.layouts
    ]
    meta[META_LAYOUTS] = layouts_json(recorded)
    cfg.metadata = meta
    try:
        await jetstream(nc, timeout=PROVISION_TIMEOUT).update_stream(cfg)
    except APIError as exc:
        raise StreamConflictError(
            f"cannot record the switch point of stream {current.name}: the server refused "
            f"the update: {exc.description}; run the repartition again to complete it"
        ) from exc
    say(
        f"switch point recorded: seq {switch} (every record of epoch {pending.epoch} is at or "
        "below it, every later one above); groups finish the old partitions before any "
        "record of the new layout"
    )
    _crash_point("switch-recorded")
    return await describe(nc, current.name, check_layout=False)


async def settled_switch_point(nc: NATS, current: PartitionedStream, closed: Layout) -> int:
    """The sequence of the last record of ``closed`` (0 if it holds none), once the stream
    can store no more of them: ``current``'s subjects no longer include ``closed``'s, and
    everything the server had queued for the stream before is stored (see the module)."""
    view = dataclasses.replace(current, epoch=closed.epoch, partitions=closed.partitions)
    probe = current.at_epoch(current.current_epoch).subject(0)
    before: int | None = None
    for _ in range(20):
        await _drain_ingest(nc, current.name, probe)
        contents = await stream_contents(nc, view)
        switch = max((s.last_seq for s in contents.partitions), default=0)
        if switch == before:
            return switch
        before = switch
    raise StreamConflictError(
        f"stream {current.name}'s old layout (epoch {closed.epoch}) keeps receiving records "
        "after its subjects were closed; run the repartition again"
    )


async def _drain_ingest(nc: NATS, stream: str, subject: str) -> None:
    """Return once the stream has stored everything the server queued for it before now:
    a probe publish to ``subject`` (one the stream takes) that expects an impossible last
    sequence is refused in the stream's ingest order, naming its last sequence L (counting
    writes still being replicated); then wait until the stream holds L."""
    js = jetstream(nc)
    reply = await nc.request(
        subject, b"", timeout=10.0, headers={"Nats-Expected-Last-Sequence": _PROBE_EXPECT}
    )
    data = json.loads(reply.data or b"{}")
    err = data.get("error") or {}
    if not err and data.get("seq"):  # stored after all (a server ignoring the header)
        with contextlib.suppress(Exception):
            await js.delete_msg(stream, int(data["seq"]))
        return
    found = _LAST_SEQ_RE.search(str(err.get("description", "")))
    if found is None:
        raise StreamConflictError(
            f"stream {stream} answered the switch point's probe with {data!r}; run the "
            "repartition again"
        )
    target = int(found.group(1))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT
    while int((await js.stream_info(stream)).state.last_seq or 0) < target:
        if loop.time() > deadline:
            raise StreamConflictError(
                f"stream {stream} did not store its queued records (up to seq {target}) "
                f"within {SETTLE_TIMEOUT:g}s; run the repartition again to complete it"
            )
        await asyncio.sleep(0.05)


def _process_gone(pid: int) -> bool:
    """True when no process ``pid`` runs on this host (or only its zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "Z"
    return False


async def _lock_kv(nc: NATS, stream: str) -> Any:
    js = jetstream(nc)
    try:
        return await js.key_value(lock_bucket(stream))
    except (BucketNotFoundError, NotFoundError):
        return await js.create_key_value(
            api.KeyValueConfig(
                bucket=lock_bucket(stream),
                ttl=LOCK_TTL,
                history=1,
                storage=api.StorageType.FILE,
                description=f"nats-ordered: one repartition of {stream} at a time",
            )
        )


async def _take_lock(kv: Any, stream: str, partitions: int, say: Callable[[str], None]) -> int:
    value = json.dumps(
        {
            "partitions": partitions,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
        }
    ).encode()
    try:
        return int(await kv.create("lock", value))
    except KeyWrongLastSequenceError:
        pass
    try:
        entry = await kv.get("lock")
        held = json.loads(entry.value or b"{}")
    except Exception:  # noqa: BLE001 - gone meanwhile: say so generically
        entry, held = None, {}
    pid = held.get("pid")
    if (
        entry is not None
        and held.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and _process_gone(pid)
    ):
        # the run that holds it was killed on this host: its stream changes, if any, are
        # completed by this run (see the module)
        with contextlib.suppress(KeyWrongLastSequenceError):
            rev = int(await kv.update("lock", value, last=entry.revision))
            say(f"took over the lock of an earlier run (pid {pid}, no longer running)")
            return rev
    age = time.time() - float(held.get("started", time.time()))
    raise RepartitionRunning(
        f"a repartition of stream {stream} is already running (to "
        f"{held.get('partitions', '?')} partitions, started {age:.0f}s ago by "
        f"{held.get('host', '?')} pid {held.get('pid', '?')}); wait for it to finish, then "
        f"check the result with `nats-ordered info --stream {stream}`. If it was killed, run "
        "the repartition again once its lock expired (after "
        f"{LOCK_TTL:g}s; at once on the same host): that run completes what it left"
    )


async def layout_refusal(nc: NATS, stream: PartitionedStream, subject: str) -> str | None:
    """Why the server refused a publish to ``subject`` with a no-responders status (no
    stream takes it), for a publisher that read ``stream`` when it started: the stream was
    repartitioned since (said in the user's terms, with the new count and epoch) or
    deleted. None when its layout is unchanged or the stream cannot be read now (a blip,
    e.g. a restarting server or a stream without a leader for a moment: retry). Never
    raises."""
    try:
        now = await describe(nc, stream.name, check_layout=False)
    except StreamNotFoundError:
        return (
            f"stream {stream.name} no longer exists (no stream takes {subject}); provision it "
            "again and restart the publish"
        )
    except Exception:  # noqa: BLE001 - no answer (a restarting server): a blip, retried
        return None
    if now.current_epoch != stream.epoch:
        return repartitioned_message(stream.name, now.partitions, now.current_epoch)
    return None
