"""Runs: what one producer id published, recorded in a ledger that outlives the dedup window.

A *run* is one producer id: an Airflow task's DAG id + task id + logical date, a Spark job's
id, a CLI user's ``--producer-id``. Whoever publishes a run records its result in the
stream's run ledger, a KV bucket ``nor_<stream>_runs`` (no TTL, the stream's replicas):

* ``status``: ``running`` (begun, not finished: the publisher died or is still going),
  ``complete`` (every record stored, none refused unless refusals were allowed),
  ``partial`` (some records failed or were refused);
* per-partition high-water marks (the stream sequence a drain waits for) and counts;
* the stream's identity (creation time), so a run of a deleted and re-created stream is
  not mistaken for one of the live stream.

Guarantees:

* **A complete run is never published again**, however long after (far past the stream's
  ``duplicate_window``): :func:`publish_run` returns the recorded result and sends nothing.
* **A partial run resumes exactly**: records are numbered per partition in input order
  (the producer sequence); the ledger keeps how many of each partition were acknowledged
  (recorded every :data:`PROGRESS_EVERY` seconds while the run goes, and at its end), and a
  re-run passes those over and sends the rest with the same msg-ids. An attempt killed
  between two progress records left more stored than recorded: when a partition's last
  message is this run's, its position counts too; otherwise the rest of that gap is
  covered by msg-id dedup inside the duplicate window. Provided the re-run reads the same
  input in the same order (the reason producer ids must name one immutable input: a DAG
  run's logical date, a job's input snapshot).
* **The marks cover every partition the run stored, whatever attempt stored it**, and
  only go up: each attempt starts from the previous attempt's marks, a partition an
  earlier attempt stored (passed over on resume) is marked at its last message, progress
  records carry the marks reached so far, and a finished run whose mark of a stored
  partition cannot be read is recorded ``partial`` (a retry reads it again), never
  ``complete`` with a hole a drain would walk through.
* Drains wait for a run by name: :meth:`RunLedger.get` gives its high-water marks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import (
    ConfigError,
    InvalidKeyError,
    InvalidMsgIdError,
    KeylessRecordError,
    MissingKeyError,
    NatsOrderedError,
    RecordError,
    RecordTooLargeError,
)
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.run_layouts import OldLayout
from airflow_nats_ordered.core.publish.summary import PublishSummary
from airflow_nats_ordered.core.publish.tails import read_tails
from airflow_nats_ordered.core.stream.keys import MAX_KEY_BYTES
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, describe

RunStatus = Literal["running", "complete", "partial"]

#: Seconds between progress records of a running run (see :func:`publish_run`).
PROGRESS_EVERY = 2.0
#: How many refused records are kept as examples (where, key, reason).
REFUSED_EXAMPLES = 5


def ledger_bucket(stream: str) -> str:
    return f"nor_{stream}_runs"


def _key(producer_id: str) -> str:
    # producer ids hold ':', '+', spaces...: KV keys may not; the id itself is in the value
    return "run." + hashlib.blake2b(producer_id.encode(), digest_size=16).hexdigest()


@dataclass
class RunRecord:
    """One run's result as recorded in the ledger (JSON-safe via :meth:`to_dict`)."""

    producer_id: str
    stream: str
    stream_created: str = ""
    status: RunStatus = "running"
    attempts: int = 0
    started: float = 0.0
    finished: float | None = None
    accepted: int = 0
    acked: int = 0
    failed: int = 0
    refused: int = 0
    duplicates: int = 0
    skipped: int = 0
    #: partition -> last stream sequence of the partition after this run (what a drain waits for)
    high_water_marks: dict[int, int] = field(default_factory=dict)
    #: partition -> records of this run acknowledged as stored (producer sequences 1..n)
    acked_per_partition: dict[int, int] = field(default_factory=dict)
    refused_reasons: dict[str, int] = field(default_factory=dict)
    #: a few refused records: ``where``, ``reason``, ``message`` and the key as
    #: :func:`example_key` gives it (JSON-safe whatever the key was)
    refused_examples: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    #: partition -> ``"<n>:<hex>"``, a digest of the msg-ids of the run's positions 1..n
    #: there, so a resume can tell that its input is still the one it started with (set by
    #: the Spark sink; left out of the JSON when empty)
    prefix_digests: dict[int, str] = field(default_factory=dict)
    #: the stream's layout epoch the partitions above refer to (0 unless the stream was
    #: repartitioned; left out of the JSON when 0)
    epoch: int = 0
    #: a run begun before a repartition: ``{"epoch", "partitions", "acked"}``, what the old
    #: layout stored of it (see :mod:`.run_layouts`; left out of the JSON when empty)
    before_switch: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["high_water_marks"] = {str(k): v for k, v in self.high_water_marks.items()}
        d["acked_per_partition"] = {str(k): v for k, v in self.acked_per_partition.items()}
        if self.prefix_digests:
            d["prefix_digests"] = {str(k): v for k, v in self.prefix_digests.items()}
        else:  # the record's documented form (docs/protocol.md, 9.4) when nobody sets it
            del d["prefix_digests"]
        if not self.epoch:
            del d["epoch"]
        if not self.before_switch:
            del d["before_switch"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        d = dict(d)
        d["high_water_marks"] = {int(k): int(v) for k, v in d.get("high_water_marks", {}).items()}
        d["acked_per_partition"] = {
            int(k): int(v) for k, v in d.get("acked_per_partition", {}).items()
        }
        d["prefix_digests"] = {int(k): str(v) for k, v in d.get("prefix_digests", {}).items()}
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


class RunLedger:
    """The run records of one stream."""

    def __init__(self, stream: PartitionedStream, kv: KeyValue) -> None:
        self.stream = stream
        self.kv = kv

    @classmethod
    async def open(
        cls, nc: NATS, stream: str | PartitionedStream, *, create: bool = True
    ) -> RunLedger:
        ps = stream if isinstance(stream, PartitionedStream) else await describe(nc, stream)
        js = jetstream(nc)
        try:
            kv = await js.key_value(ledger_bucket(ps.name))
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise NatsOrderedError(
                    f"stream {ps.name} has no run ledger yet: nothing was published to it as a "
                    "named run"
                ) from None
            kv = await js.create_key_value(
                api.KeyValueConfig(
                    bucket=ledger_bucket(ps.name),
                    history=5,
                    replicas=ps.replicas or 1,
                    storage=api.StorageType.FILE,
                    description=f"nats-ordered run ledger of stream {ps.name}",
                )
            )
        return cls(ps, kv)

    async def _read(self, producer_id: str) -> tuple[RunRecord | None, int]:
        try:
            e = await self.kv.get(_key(producer_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        rec = RunRecord.from_dict(json.loads(e.value or b"{}"))
        return rec, e.revision or 0

    async def get(self, producer_id: str) -> RunRecord | None:
        """The run's record, or None. A record of an earlier stream of the same name (deleted
        and re-created since) counts as none."""
        rec, _ = await self._read(producer_id)
        if rec is not None and _other_incarnation(rec, self.stream):
            return None
        return rec

    async def begin(self, producer_id: str) -> RunRecord:
        """Mark the run as running (one more attempt); returns the record to resume from."""
        for _ in range(10):
            rec, rev = await self._read(producer_id)
            if rec is None or _other_incarnation(rec, self.stream):
                rec = RunRecord(
                    producer_id, self.stream.name, self.stream.created, epoch=self.stream.epoch
                )
            elif rec.epoch != self.stream.epoch:
                # begun before a repartition: its positions and marks are of the old layout's
                # partitions; this attempt sends the run again on the new layout (msg-id
                # de-duplication drops what the old layout already stored), and a drain
                # covers the old layout's records by the group's layout epoch
                rec.acked_per_partition, rec.high_water_marks, rec.prefix_digests = {}, {}, {}
                rec.epoch = self.stream.epoch
            rec.status = "running"
            rec.attempts += 1
            rec.started = time.time()
            rec.finished = None
            rec.error = None
            try:
                if rev == 0:
                    await self.kv.create(_key(producer_id), _dump(rec))
                else:
                    await self.kv.update(_key(producer_id), _dump(rec), last=rev)
            except KeyWrongLastSequenceError:
                continue
            return rec
        raise NatsOrderedError(f"run {producer_id!r}: its ledger record keeps changing under us")

    async def record(self, rec: RunRecord) -> None:
        """Write the run's result (last writer wins: one run is published by one task)."""
        await self.kv.put(_key(rec.producer_id), _dump(rec))

    async def delete(self, producer_id: str) -> None:
        """Forget a run, so that publishing it again sends everything (a deliberate replay)."""
        with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
            await self.kv.delete(_key(producer_id))


def _other_incarnation(rec: RunRecord, stream: PartitionedStream) -> bool:
    """The record is of an earlier stream of the same name (deleted and re-created)."""
    return bool(rec.stream_created and stream.created and rec.stream_created != stream.created)


def _dump(rec: RunRecord) -> bytes:
    return json.dumps(rec.to_dict(), separators=(",", ":")).encode()


class SourceRecord(Protocol):
    """What :func:`publish_run` reads: the CLI's, Airflow's and Spark's input records fit.
    A record may also carry ``headers`` (a dict of extra headers, e.g. from Spark's
    ``headers`` column)."""

    @property
    def key(self) -> str | bytes | None: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def msg_id(self) -> str | None: ...
    @property
    def where(self) -> str: ...


@dataclass
class Refusals:
    """Records refused before sending, by reason, with a few examples."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, rec: SourceRecord, message: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < REFUSED_EXAMPLES:
            self.examples.append(
                {"where": rec.where, "reason": reason, **example_key(rec.key), "message": message}
            )


def example_key(key: object) -> dict[str, Any]:
    """A refused record's key as JSON-safe fields of its example (the run ledger, the
    Spark commit, XCom and ``--json`` write them as JSON):

    * ``key``: the key's text (a ``str``, or ``bytes`` that are UTF-8), None when keyless;
    * ``key_b64`` instead, when the key is bytes that are not UTF-8 (what ``bad key``
      refuses): the standard base64 of those bytes, and ``key`` is None;
    * ``key_length``, only when the key is longer than :data:`~..stream.keys.MAX_KEY_BYTES`: its
      full length in bytes; ``key``/``key_b64`` then hold its first MAX_KEY_BYTES
      characters (bytes), so that five examples always fit in one ledger record.

    Any other type (a caller's int, say) is given as its ``repr``."""
    if key is None:
        return {"key": None}
    if isinstance(key, str):
        if len(key) <= MAX_KEY_BYTES:
            return {"key": key}
        return {"key": key[:MAX_KEY_BYTES], "key_length": len(key.encode("utf-8", "replace"))}
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        out: dict[str, Any]
        try:
            out = {"key": raw.decode("utf-8")[:MAX_KEY_BYTES]}
        except UnicodeDecodeError:
            out = {"key": None, "key_b64": base64.b64encode(raw[:MAX_KEY_BYTES]).decode("ascii")}
        if len(raw) > MAX_KEY_BYTES:
            out["key_length"] = len(raw)
        return out
    return example_key(repr(key))


_REASONS: tuple[tuple[type[RecordError], str], ...] = (
    (MissingKeyError, "no key"),
    (InvalidKeyError, "bad key"),
    (RecordTooLargeError, "too large"),
    (InvalidMsgIdError, "bad msg-id"),
    (RecordError, "refused"),
)


async def publish_record(
    pub: OrderedPublisher,
    rec: SourceRecord,
    refusals: Refusals,
    *,
    msg_id_field: str | None = None,
    keyless_switch: str | None = None,
) -> bool:
    """Publish one record; a refused one is counted in ``refusals`` with why (never dropped
    silently). ``keyless_switch`` words the missing-key refusal in the caller's terms (the
    CLI: ``--allow-keyless``). True if the record was accepted."""
    if msg_id_field and rec.msg_id is None:
        refusals.add("no msg-id", rec, f"field {msg_id_field!r} is missing or empty")
        return False
    try:
        await pub.publish(
            rec.key, rec.payload, msg_id=rec.msg_id, headers=getattr(rec, "headers", None)
        )
    except RecordError as exc:
        reason = next(r for t, r in _REASONS if isinstance(exc, t))
        text = str(exc)
        if keyless_switch and isinstance(exc, KeylessRecordError):
            text = exc.message_for(keyless_switch)
        refusals.add(reason, rec, text)
        return False
    return True


async def publish_records(
    pub: OrderedPublisher,
    records: Iterable[SourceRecord] | AsyncIterable[SourceRecord],
    refusals: Refusals,
    *,
    msg_id_field: str | None = None,
) -> int:
    """Publish every record; refused ones are counted in ``refusals`` (never dropped
    silently). Returns how many records were read. (A resumed run's publisher passes over
    what an earlier attempt stored itself: ``OrderedPublisher(start_after=...)``.)"""
    read = 0

    async def one(rec: SourceRecord) -> None:
        await publish_record(pub, rec, refusals, msg_id_field=msg_id_field)

    if isinstance(records, AsyncIterable):
        async for rec in records:
            read += 1
            await one(rec)
    else:
        for rec in records:
            read += 1
            await one(rec)
    return read


@dataclass
class RunResult:
    """What :func:`publish_run` did. ``skipped``: the run was complete already."""

    record: RunRecord
    skipped: bool
    summary: PublishSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        # the record's own "skipped" counts records passed over on resume
        return {**self.record.to_dict(), "already_complete": self.skipped}


async def publish_run(
    nc: NATS,
    stream: str,
    records: Iterable[SourceRecord] | AsyncIterable[SourceRecord],
    *,
    producer_id: str,
    config: PublisherConfig | None = None,
    allow_refused: bool = False,
    msg_id_field: str | None = None,
    expected_partitions: int | None = None,
) -> RunResult:
    """Publish ``records`` as the run ``producer_id``, at most once per run.

    A run the ledger has as complete is not published again (``skipped``); a partial or
    interrupted one resumes after what it had stored. The result is recorded whatever
    happens; a run with failed records, or refused ones without ``allow_refused``, is
    recorded ``partial`` (the caller decides whether that fails its task).

    A publisher refused by the server (the stream repartitioned or deleted meanwhile, a
    record it will not store) ends: the run is recorded ``partial`` with the refusal as its
    error, and publishing the same input as the same run again completes it (across a
    repartition, the ledger passes over what the old layout stored: :mod:`.run_layouts`).
    A publish the server refused for want of a permission raises
    :class:`~..errors.PermissionDenied` once the run is recorded ``partial``.
    """
    if not producer_id or not producer_id.strip():
        raise ConfigError("producer_id must name the run (e.g. '<dag>.<task>.<logical date>')")
    for _ in range(_BEGINNINGS):
        result = await _attempt(
            nc,
            stream,
            records,
            producer_id=producer_id,
            config=config,
            allow_refused=allow_refused,
            msg_id_field=msg_id_field,
            expected_partitions=expected_partitions,
        )
        if result is not None:
            return result
    raise NatsOrderedError(
        f"stream {stream} was repartitioned each of the {_BEGINNINGS} times run "
        f"{producer_id!r} began, before anything was sent; run it again once the stream's "
        "partition count stays put (nothing of this attempt was sent)"
    )


#: how often :func:`publish_run` begins a run again when the stream was repartitioned
#: between reading the ledger and starting the publisher (nothing was sent yet)
_BEGINNINGS = 3


async def _attempt(
    nc: NATS,
    stream: str,
    records: Iterable[SourceRecord] | AsyncIterable[SourceRecord],
    *,
    producer_id: str,
    config: PublisherConfig | None,
    allow_refused: bool,
    msg_id_field: str | None,
    expected_partitions: int | None,
) -> RunResult | None:
    """One attempt of :func:`publish_run`; None, having sent nothing, when the publisher
    found the stream on a newer layout than the ledger's record was begun for."""
    ledger = await RunLedger.open(nc, stream)
    previous = await ledger.get(producer_id)
    if previous is not None and previous.status == "complete":
        return RunResult(previous, skipped=True)
    rec = await ledger.begin(producer_id)
    base = config or PublisherConfig()
    # the caller's settings with the run's producer id (its global_order, an object, as is)
    run_config = replace(base, producer_id=producer_id)
    # what earlier attempts had stored, by partition: passed over, not re-sent; such a
    # partition's mark is at least its last message now (the earlier attempt's records
    # are at or before it), recorded at once so that even a progress record has it
    resume: dict[int, int] = {}
    fence: dict[int, int] | None = None
    old_layout: OldLayout | None = None
    if previous is not None and previous.epoch != ledger.stream.epoch:
        old_layout = await _carry_over(nc, ledger, rec, previous)
    elif previous is not None and rec.before_switch:
        old_layout = OldLayout(
            int(rec.before_switch["partitions"]),
            {int(p): int(n) for p, n in rec.before_switch["acked"].items()},
        )
    if previous is not None and previous.epoch == ledger.stream.epoch:
        resume, tails = await stored_positions(nc, ledger.stream, producer_id, previous)
        # an earlier attempt may still be storing records (a zombie: its process lives on):
        # each partition's first record expects the subject to end where it ends now
        fence = tails
        raise_marks(rec, {p: tails[p] for p, n in resume.items() if n and p in tails})
        with contextlib.suppress(Exception):  # best effort: the final record follows
            await ledger.record(rec)
    pub = OrderedPublisher(
        nc,
        stream,
        run_config,
        expected_partitions=expected_partitions,
        start_after=resume,
        fence=fence,
        old_layout=old_layout,
    )
    refusals = Refusals()
    summary: PublishSummary | None = None
    progress: asyncio.Task[None] | None = None
    try:
        if not await _started_on(pub, ledger):
            return None  # begin again: the positions to pass over are of another layout
        progress = asyncio.ensure_future(_record_progress(ledger, rec, pub))
        await publish_records(pub, records, refusals, msg_id_field=msg_id_field)
        summary = await pub.close(raise_on_failure=False)
    except BaseException as exc:
        if progress is not None:
            progress.cancel()
        rec.error = f"{type(exc).__name__}: {exc}"
        rec.status = "partial"
        rec.finished = time.time()
        with contextlib.suppress(Exception):
            await pub.close(raise_on_failure=False)
        _absorb(rec, pub.summary, refusals)
        raise_marks(rec, _live_marks(pub))
        with contextlib.suppress(Exception):
            await fill_marks(nc, ledger.stream, rec)
        await ledger.record(rec)
        raise
    progress.cancel()
    _absorb(rec, summary, refusals)
    unmarked = await fill_marks(nc, ledger.stream, rec)
    complete = rec.failed == 0 and (rec.refused == 0 or allow_refused) and not unmarked
    rec.status = "complete" if complete else "partial"
    rec.finished = time.time()
    if summary is not None and summary.failed:
        rec.error = next((p.error for p in summary.partitions if p.error), None)
    elif unmarked:
        rec.error = unmarked_error(unmarked)
    await ledger.record(rec)
    if pub.denied is not None:  # recorded partial; no retry passes without the permission
        raise pub.denied
    return RunResult(rec, skipped=False, summary=summary)


async def _started_on(pub: OrderedPublisher, ledger: RunLedger) -> bool:
    """Start ``pub``; False, closed with nothing sent, when it read the stream on another
    layout than ``ledger`` did (repartitioned in between): the run's record was begun, and
    its positions to pass over computed, for the ledger's layout, and publishing them on
    another one would pass over records never stored."""
    try:
        await pub.start()
    except ConfigError:  # e.g. start_after names a partition the new layout lacks
        if (await describe(pub.nc, ledger.stream.name)).epoch != ledger.stream.epoch:
            return False
        raise
    if pub.stream.epoch == ledger.stream.epoch:
        return True
    await pub.close(raise_on_failure=False)
    return False


async def _carry_over(
    nc: NATS, ledger: RunLedger, rec: RunRecord, previous: RunRecord
) -> OldLayout:
    """The run was begun on an earlier layout: record what that layout stored of it
    (``before_switch``): the publisher passes those records over (see :mod:`.run_layouts`)."""
    if previous.before_switch:
        raise ConfigError(
            f"run {previous.producer_id!r} was begun before two repartitions of stream "
            f"{ledger.stream.name} (epochs {previous.before_switch.get('epoch')} and "
            f"{previous.epoch}); it cannot be resumed exactly: publish it under a new "
            "producer id, or delete its ledger record to send it all again"
        )
    old = ledger.stream.at_epoch(previous.epoch)
    stored, _ = await stored_positions(nc, old, rec.producer_id, previous)
    rec.before_switch = {
        "epoch": old.epoch,
        "partitions": old.partitions,
        "acked": {str(p): n for p, n in stored.items()},
    }
    await ledger.record(rec)
    return OldLayout(old.partitions, stored)


async def stored_positions(
    nc: NATS, stream: PartitionedStream, producer_id: str, previous: RunRecord
) -> tuple[dict[int, int], dict[int, int]]:
    """Per partition, how many leading positions of the run are stored: what the ledger
    recorded, or more when the partition's last message is this run's (an attempt killed
    between two progress records; its ``Nats-Ordered-Seq`` is the position). Also each
    partition's last stream sequence (partitions without messages are left out)."""
    out = dict(previous.acked_per_partition)
    read = await read_tails(nc, stream, producer_id)
    for p, t in read.items():
        if t.position:
            out[p] = max(out.get(p, 0), t.position)
    return out, {p: t.seq for p, t in read.items()}


def raise_marks(rec: RunRecord, marks: dict[int, int]) -> None:
    """Raise ``rec``'s high-water marks to ``marks`` where higher: marks never go down
    (a mark is a stream sequence the drain waits for; a later attempt only adds records)."""
    for p, seq in marks.items():
        if seq and seq > rec.high_water_marks.get(p, 0):
            rec.high_water_marks[p] = int(seq)


def _live_marks(pub: OrderedPublisher) -> dict[int, int]:
    """Per partition, the last stream sequence the publisher has been acknowledged so far
    (0 until its first acknowledgement with a sequence)."""
    return {lane.p: lane.summary.last_seq for lane in pub._lanes}


async def fill_marks(nc: NATS, stream: PartitionedStream, rec: RunRecord) -> list[int]:
    """Mark every partition the run stored records on (``acked_per_partition``) that has no
    high-water mark yet at its last message (the run's records are at or before it).
    Returns the partitions whose mark still could not be read (the run must not be
    called complete: a drain would not wait for them)."""
    missing = [
        p for p, n in rec.acked_per_partition.items() if n and not rec.high_water_marks.get(p)
    ]
    if not missing:
        return []
    js = jetstream(nc)

    async def last(p: int) -> None:
        with contextlib.suppress(NotFoundError, TimeoutError, NatsError):
            msg = await js.get_last_msg(stream.name, stream.subject(p), direct=True)
            raise_marks(rec, {p: int(msg.seq or 0)})

    for _ in range(3):
        await asyncio.gather(*(last(p) for p in missing))
        missing = [p for p in missing if not rec.high_water_marks.get(p)]
        if not missing:
            break
        await asyncio.sleep(0.5)
    return sorted(missing)


def unmarked_error(partitions: list[int]) -> str:
    return (
        f"the high-water mark of partition(s) {partitions} (records of this run are stored "
        "there) could not be read from the stream, so a drain could not wait for them; the "
        "run is left partial: run it again (it sends nothing twice) once the stream answers"
    )


async def _record_progress(ledger: RunLedger, rec: RunRecord, pub: OrderedPublisher) -> None:
    """Keep the ledger's per-partition counts at most PROGRESS_EVERY seconds behind, so a
    killed attempt's successor passes over nearly everything it stored."""
    while True:
        await asyncio.sleep(PROGRESS_EVERY)
        positions = pub.stored_positions()
        marks = dict(rec.high_water_marks)
        raise_marks(rec, _live_marks(pub))
        if positions != rec.acked_per_partition or marks != rec.high_water_marks:
            rec.acked_per_partition.update(positions)
            rec.acked = sum(rec.acked_per_partition.values())
            with contextlib.suppress(Exception):  # best effort: the final record follows
                await ledger.record(rec)


def _absorb(rec: RunRecord, summary: PublishSummary | None, refusals: Refusals) -> None:
    rec.refused = refusals.total
    rec.refused_reasons = dict(refusals.counts)
    rec.refused_examples = list(refusals.examples)
    if summary is None:
        return
    rec.accepted = summary.accepted
    rec.failed = summary.failed
    rec.duplicates = summary.duplicates
    for p in summary.partitions:
        # records skipped on resume were stored by an earlier attempt: they count as stored
        rec.acked_per_partition[p.partition] = p.offset + p.acked
    # marks only go up: an earlier attempt's mark stays unless this attempt's is higher
    raise_marks(rec, summary.high_water_marks)
    rec.acked = sum(rec.acked_per_partition.values())
    rec.skipped = sum(p.offset for p in summary.partitions)
