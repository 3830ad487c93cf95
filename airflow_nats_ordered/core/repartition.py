"""Changing a stream's partition count without breaking any key's order (issue 18 part 2).

:func:`repartition` is one stream configuration update: the stream's subjects become the
new epoch's (``<prefix>.p.e<k>-<n>``, see :mod:`.layout`) and its metadata says epoch ``k``,
``N`` partitions and the earlier layouts. From that update on the server refuses every
publish routed by an earlier layout (no stream takes those subjects any more), so a
publisher that started before it fails with the stream's new layout named instead of
routing a key to a partition its readers do not expect. The *switch point*, the stream's
last sequence right after the update, is then recorded with the closed layout: every record
of it has a sequence at or below it.

Records of the closed layout stay in the stream and stay readable (consumers may filter on
subjects the stream no longer takes; checked on nats-server 2.15). A consumer group
finishes them first: its workers process the old epoch's partitions exactly as before, and
the group moves to the new epoch only once every old partition's commit covers its last
record (murmur3 sends the keys of any old partition to any new one, so the barrier is over
all old partitions). See :mod:`.worker_epochs`.

One repartition of a stream runs at a time: a lock key (``lock`` in the KV bucket
``nor_<stream>_repartition``, expiring :data:`LOCK_TTL` seconds after it was taken, so a
crashed run does not hold it forever) refuses a second one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError, BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError

from .errors import ConfigError, NatsOrderedError, StreamConflictError, StreamNotFoundError
from .global_watermarks import watermark_bucket
from .layout import META_EPOCH, META_LAYOUTS, Layout, layouts_json, repartitioned_message
from .streams import (
    MAX_PARTITIONS,
    META_PARTITIONS,
    PROVISION_TIMEOUT,
    PartitionedStream,
    describe,
)

#: seconds a repartition's lock lives: longer than the update may take
LOCK_TTL = 300.0


class RepartitionRunning(NatsOrderedError):
    """Another repartition of the stream holds the lock."""


@dataclass(frozen=True)
class RepartitionResult:
    """What :func:`repartition` did: the stream went from ``previous_partitions`` (epoch
    ``epoch - 1`` or earlier) to ``partitions`` in ``epoch``; records of the earlier layout
    all have sequences at or below ``switch_seq``."""

    stream: str
    previous_partitions: int
    previous_epoch: int
    partitions: int
    epoch: int
    switch_seq: int
    subjects: str

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "previous_partitions": self.previous_partitions,
            "previous_epoch": self.previous_epoch,
            "partitions": self.partitions,
            "epoch": self.epoch,
            "switch_seq": self.switch_seq,
            "subjects": self.subjects,
        }


def lock_bucket(stream: str) -> str:
    return f"nor_{stream}_repartition"


async def repartition(
    nc: NATS,
    stream: str,
    partitions: int,
    *,
    progress: Callable[[str], None] | None = None,
) -> RepartitionResult:
    """Switch ``stream`` to ``partitions`` partitions at one recorded point (see the module).

    Refuses (ConfigError) a count outside 1..4096 or equal to the current one, a stream that
    still takes the wildcard ``<prefix>.p.*`` (narrow it with ``provision`` first), a stream
    published in global order (its watermark bucket exists);
    StreamNotFoundError for an unknown stream; :class:`RepartitionRunning` while another
    repartition of it runs. ``progress`` gets one line per step."""
    say = progress or (lambda _line: None)
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise ConfigError(f"partitions must be an integer, got {partitions!r}")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigError(f"partitions must be from 1 to {MAX_PARTITIONS}, got {partitions}")
    current = await describe(nc, stream)
    if partitions == current.partitions:
        raise ConfigError(
            f"stream {stream} already has {partitions} partitions (epoch {current.epoch}); "
            "nothing to change: pass another partition count"
        )
    if not current.explicit_subjects:
        raise ConfigError(
            f"stream {stream} still takes the wildcard subject {current.prefix}.p.*; narrow it "
            f"to its partition subjects first: `nats-ordered provision --stream {stream} "
            f"--partitions {current.partitions}`"
        )
    await _refuse_global_order(nc, stream)
    kv = await _lock_kv(nc, stream)
    rev = await _take_lock(kv, stream, partitions)
    try:
        return await _switch(nc, stream, partitions, say)
    finally:
        with contextlib.suppress(Exception):  # else it expires after LOCK_TTL
            await kv.delete("lock", last=rev)


async def _refuse_global_order(nc: NATS, stream: str) -> None:
    """A stream published in global order has watermarks per partition of its layout, and
    its global-order readers merge that layout's partitions: neither follows a switch yet."""
    bucket = watermark_bucket(stream)
    try:
        await nc.jetstream().key_value(bucket)
    except BucketNotFoundError:
        return
    raise ConfigError(
        f"stream {stream} is published in global order (its watermarks are in KV bucket "
        f"{bucket}), and the global-order publisher and reader follow one partition layout: "
        "repartitioning it would stall or misorder its global-order readers. If nothing "
        f"publishes or reads {stream} in global order any more, delete that bucket "
        f"(`nats kv del {bucket}`) and repartition again; otherwise keep its partition count"
    )


async def _switch(
    nc: NATS, stream: str, partitions: int, say: Callable[[str], None]
) -> RepartitionResult:
    js = nc.jetstream()
    admin = nc.jetstream(timeout=PROVISION_TIMEOUT)
    current = await describe(nc, stream)  # again, under the lock
    if partitions == current.partitions:
        raise ConfigError(
            f"stream {stream} already has {partitions} partitions (epoch {current.epoch})"
        )
    layouts = list(current.layouts)
    if layouts and not layouts[-1].switch_seq:
        # an earlier run stopped between its update and recording the switch point: its
        # layout's records all have sequences at or below the last sequence now
        last = await _last_seq(js, stream)
        layouts[-1] = Layout(layouts[-1].epoch, layouts[-1].partitions, current.prefix, last)
        say(f"recorded the switch point of the interrupted repartition: seq {last}")
    closed = Layout(current.epoch, current.partitions, current.prefix)
    new = Layout(current.epoch + 1, partitions, current.prefix)
    say(
        f"stream {stream}: closing layout epoch {closed.epoch} ({closed.partitions} partitions, "
        f"{closed.subject(0)} ...); opening epoch {new.epoch} ({new.partitions} partitions, "
        f"{new.subject(0)} ...)"
    )
    cfg = current.config
    cfg.subjects = new.subjects
    meta = dict(cfg.metadata or {})
    meta.update(
        {
            META_PARTITIONS: str(partitions),
            META_EPOCH: str(new.epoch),
            META_LAYOUTS: layouts_json([*layouts, closed]),
        }
    )
    cfg.metadata = meta
    size = len(json.dumps(cfg.as_dict()).encode())
    if nc.max_payload and size > nc.max_payload:
        raise ConfigError(
            f"stream {stream}'s configuration with {partitions} partition subjects is {size} "
            f"bytes, more than the server's max_payload ({nc.max_payload}): use fewer partitions"
        )
    try:
        await admin.update_stream(cfg)
    except APIError as exc:
        raise StreamConflictError(
            f"cannot repartition stream {stream}: the server refused the update: {exc.description}"
        ) from exc
    say(f"the server now refuses publishes routed by epoch {closed.epoch}'s layout")
    switch = await _last_seq(js, stream)
    closed = Layout(closed.epoch, closed.partitions, closed.prefix, switch)
    info = await js.stream_info(stream)
    cfg = info.config
    meta = dict(cfg.metadata or {})
    meta[META_LAYOUTS] = layouts_json([*layouts, closed])
    cfg.metadata = meta
    await admin.update_stream(cfg)
    say(
        f"switch point recorded: seq {switch} (every record of epoch {closed.epoch} is at or "
        "below it); groups finish the old partitions before any record of the new layout"
    )
    return RepartitionResult(
        stream,
        closed.partitions,
        closed.epoch,
        partitions,
        new.epoch,
        switch,
        f"{new.subject(0)} to {new.subject(partitions - 1)}",
    )


async def _last_seq(js: Any, stream: str) -> int:
    info = await js.stream_info(stream)
    return int(info.state.last_seq or 0)


async def _lock_kv(nc: NATS, stream: str) -> Any:
    js = nc.jetstream()
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


async def _take_lock(kv: Any, stream: str, partitions: int) -> int:
    value = {
        "partitions": partitions,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
    }
    try:
        return int(await kv.create("lock", json.dumps(value).encode()))
    except KeyWrongLastSequenceError:
        pass
    try:
        held = json.loads((await kv.get("lock")).value or b"{}")
    except Exception:  # noqa: BLE001 - gone meanwhile: say so generically
        held = {}
    age = time.time() - float(held.get("started", time.time()))
    raise RepartitionRunning(
        f"a repartition of stream {stream} is already running (to "
        f"{held.get('partitions', '?')} partitions, started {age:.0f}s ago by "
        f"{held.get('host', '?')} pid {held.get('pid', '?')}); wait for it to finish, then "
        f"check the result with `nats-ordered info --stream {stream}` (the lock of a run that "
        f"crashed expires {LOCK_TTL:g}s after it was taken)"
    )


async def layout_refusal(nc: NATS, stream: PartitionedStream, subject: str) -> str | None:
    """Why the server refused a publish to ``subject`` with a no-responders status (no
    stream takes it), for a publisher that read ``stream`` when it started: the stream was
    repartitioned since (said in the user's terms, with the new count and epoch) or
    deleted. None when its layout is unchanged or the stream cannot be read now (a blip,
    e.g. a restarting server or a stream without a leader for a moment: retry). Never
    raises."""
    try:
        now = await describe(nc, stream.name)
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
