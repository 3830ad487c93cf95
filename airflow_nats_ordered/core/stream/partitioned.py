"""Partitioned streams: the spec, idempotent create-or-verify, and read-back of the contract.

A partitioned stream is one JetStream stream whose subjects are exactly the list
``<prefix>.p.0`` ... ``<prefix>.p.<P-1>`` (no wildcard), so the server itself refuses a publish
to any other subject (``.p.<P>``, ``.p.99``, ``.p.00``, ``.p.x``: a JetStream publish gets no
ack). The partition count, hash name and seed live in the stream metadata, so publishers and
workers read P from the server and never guess it. P cannot change in place: a different
count would silently move keys to other partitions and break per-key order, so a mismatch is
always an error.

Streams created before the explicit list have the wildcard ``<prefix>.p.*`` as their subjects;
they keep working (:func:`describe` accepts both shapes) and :func:`provision` narrows them in
place. Messages such a stream stored on a non-partition subject are *strays*: no worker ever
reads them. :func:`stream_contents` counts them next to the partitions, ``info`` and
``status`` report them, a drain wait fails on them, and :func:`purge_strays` removes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from airflow_nats_ordered.core.connection.api import api_subject, jetstream
from airflow_nats_ordered.core.errors import (
    ConfigError,
    PartitionMismatchError,
    StreamConflictError,
    StreamNotFoundError,
)
from airflow_nats_ordered.core.stream.layout import (
    Layout,
    is_partition_subject,
    layout_subject,
    partition_of,
    read_layouts,
    subjects_layout,
)
from airflow_nats_ordered.core.stream.partitioning import (
    HASH_NAME,
    HASH_SEED,
    partition_subject,
    partition_subjects,
    partition_wildcard,
)
from airflow_nats_ordered.core.stream.strays import Strays

META_PARTITIONS = "nats-ordered.partitions"
META_HASH = "nats-ordered.hash"
META_SEED = "nats-ordered.seed"
META_PREFIX = "nats-ordered.prefix"
META_FORMAT = "nats-ordered.format"
FORMAT_VERSION = "1"

#: Default msg-id de-duplication window: longer than a Spark task retry plus an Airflow task
#: retry with its delay. Raise it to cover your slowest rerun; the server keeps every msg-id
#: of the window in memory (about 100 bytes each).
DEFAULT_DUPLICATE_WINDOW = 3600.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
MAX_PARTITIONS = 4096
#: seconds a stream create or update may take: the server checks every subject of the
#: request against the others and the account's streams (measured on a loaded 2-core
#: machine: 4096 partitions 0.5-2.4 s with a short prefix, 1-9 s with a 40-character one)
PROVISION_TIMEOUT = 120.0


#: what a stream name may hold, in words (messages of the CLI and the operators)
STREAM_NAME_RULE = "1-200 letters, digits, '_' or '-' (no dots, spaces, wildcards or slashes)"


def check_stream_name(name: str) -> str:
    """``name`` if a partitioned stream may be called so (:data:`STREAM_NAME_RULE`: JetStream
    refuses '.', '*', '>', blanks and path separators, and the stream's KV buckets and
    dead-letter stream take their names from it); else ConfigError saying the rule."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"stream name {name!r} is not valid: use {STREAM_NAME_RULE}")
    return name


@dataclass(frozen=True)
class StreamSpec:
    """What a partitioned stream should look like.

    ``duplicate_window`` (seconds) bounds how late a retried or rerun publish is still
    de-duplicated by ``Nats-Msg-Id``: set it longer than your longest retry (Spark task
    retries, Airflow task retries with their delay, a backfill rerun policy).
    """

    name: str
    partitions: int = 16
    subject_prefix: str | None = None
    replicas: int = 1
    storage: Literal["file", "memory"] = "file"
    max_age: float | None = None
    max_bytes: int | None = None
    max_msgs: int | None = None
    max_msg_size: int | None = None
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW
    description: str | None = None

    def __post_init__(self) -> None:
        check_stream_name(self.name)
        if not isinstance(self.partitions, int) or not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ConfigError(
                f"partitions must be an integer from 1 to {MAX_PARTITIONS}, got {self.partitions!r}"
            )
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigError(
                f"subject prefix {self.prefix!r} is not valid: dot-separated tokens of letters, "
                "digits, '_' or '-', no wildcards"
            )
        if self.replicas not in (1, 2, 3, 4, 5):
            raise ConfigError(f"replicas must be 1 to 5, got {self.replicas!r}")
        if self.storage not in ("file", "memory"):
            raise ConfigError(f"storage must be 'file' or 'memory', got {self.storage!r}")
        if not self.duplicate_window or self.duplicate_window <= 0:
            raise ConfigError(
                "duplicate_window must be > 0 seconds: msg-id de-duplication is what makes "
                "retries and reruns store nothing twice"
            )
        if self.max_age is not None and self.max_age < self.duplicate_window:
            raise ConfigError(
                f"max_age ({self.max_age:g}s) must be at least duplicate_window "
                f"({self.duplicate_window:g}s); lower duplicate_window or raise max_age"
            )

    @property
    def prefix(self) -> str:
        """The subject prefix: ``subject_prefix`` or the stream name in lower case."""
        return self.subject_prefix or self.name.lower()

    @property
    def subjects(self) -> list[str]:
        """The stream's subjects: exactly its partition subjects, nothing else."""
        return partition_subjects(self.prefix, self.partitions)

    def metadata(self) -> dict[str, str]:
        """The contract written into the stream metadata."""
        return {
            META_PARTITIONS: str(self.partitions),
            META_HASH: HASH_NAME,
            META_SEED: str(HASH_SEED),
            META_PREFIX: self.prefix,
            META_FORMAT: FORMAT_VERSION,
        }

    def stream_config(self) -> api.StreamConfig:
        """The JetStream configuration for this spec.

        ``allow_batched`` enables the fast-ingest batches the ordered publisher uses;
        ``allow_direct`` serves per-partition last-message reads from any replica.
        """
        return api.StreamConfig(
            name=self.name,
            description=self.description,
            subjects=self.subjects,
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE if self.storage == "file" else api.StorageType.MEMORY,
            num_replicas=self.replicas,
            max_age=self.max_age or 0,
            max_bytes=self.max_bytes if self.max_bytes is not None else -1,
            max_msgs=self.max_msgs if self.max_msgs is not None else -1,
            max_msg_size=self.max_msg_size if self.max_msg_size is not None else -1,
            duplicate_window=self.duplicate_window,
            allow_direct=True,
            allow_batched=True,
            metadata=self.metadata(),
        )


class LayoutMismatchError(StreamConflictError):
    """The stream's partition subjects are not those its metadata describes (an interrupted
    or hand-made change): publishers, workers and ``info`` would each read another layout."""


@dataclass(frozen=True)
class PartitionedStream:
    """A partitioned stream as the server describes it."""

    name: str
    prefix: str
    partitions: int
    hash_name: str
    seed: int
    replicas: int
    storage: str
    duplicate_window: float
    max_msg_size: int
    allow_batched: bool
    config: api.StreamConfig = field(repr=False, compare=False)
    #: The stream's identity: its creation time as the server reports it (ISO 8601, UTC).
    #: It survives restarts, leader changes and config updates, and changes when the stream
    #: is deleted and created again under the same name. Empty if the server did not say.
    created: str = ""
    #: True when the stream's subjects are exactly its partition subjects, so the server
    #: refuses every other publish; False for a stream still on the wildcard
    #: ``<prefix>.p.*`` (or other subjects), which stores what it cannot route as strays.
    explicit_subjects: bool = False
    #: the layout epoch this describes (the stream's current one unless :meth:`at_epoch`
    #: gave an earlier one) and the stream's earlier layouts (see :mod:`.layout`)
    epoch: int = 0
    layouts: tuple[Layout, ...] = ()
    #: the stream's current epoch (``epoch`` differs in a view of an earlier layout)
    current_epoch: int = 0

    def subject(self, partition: int) -> str:
        return layout_subject(self.prefix, self.epoch, partition)

    @property
    def layout(self) -> Layout:
        return Layout(self.epoch, self.partitions, self.prefix)

    @property
    def oldest_epoch(self) -> int:
        """The epoch of the stream's oldest recorded layout (0 unless repartitioned)."""
        return self.layouts[0].epoch if self.layouts else self.current_epoch

    def at_epoch(self, epoch: int) -> PartitionedStream:
        """This stream as seen by a reader of layout ``epoch`` (its partition count and
        subjects); ValueError for an epoch the stream never had."""
        if epoch == self.current_epoch:
            return dataclasses.replace(self, epoch=epoch, partitions=self.current_partitions)
        for lay in self.layouts:
            if lay.epoch == epoch:
                return dataclasses.replace(self, epoch=epoch, partitions=lay.partitions)
        raise ValueError(f"stream {self.name} has no layout epoch {epoch}")

    @property
    def pending_switch(self) -> Layout | None:
        """The earlier layout whose switch point is not recorded yet (a repartition still
        running, or interrupted: the next ``repartition`` run completes it), else None."""
        return next((lay for lay in self.layouts if lay.pending), None)

    @property
    def current_partitions(self) -> int:
        return int((self.config.metadata or {}).get(META_PARTITIONS, self.partitions))

    @property
    def subjects_text(self) -> str:
        """The subjects it accepts, in words: ``orders.p.0 to orders.p.15`` or the list."""
        if self.explicit_subjects:
            if self.epoch:
                return f"{self.subject(0)} to {self.subject(self.partitions - 1)}"
            return subjects_text(self.prefix, self.partitions)
        return ", ".join(self.config.subjects or []) or "(none)"


def subjects_text(prefix: str, partitions: int) -> str:
    """``<prefix>.p.0 to <prefix>.p.<P-1>`` (or the single subject of a 1-partition stream)."""
    first = partition_subject(prefix, 0)
    return first if partitions == 1 else f"{first} to {partition_subject(prefix, partitions - 1)}"


@dataclass(frozen=True)
class StreamContents:
    """What a stream holds, from one read: each partition's stats and the strays."""

    partitions: list[PartitionStats]
    strays: Strays

    @property
    def messages(self) -> int:
        """Every message in the stream: the partitions' and the strays'."""
        return sum(s.messages for s in self.partitions) + self.strays.messages


@dataclass(frozen=True)
class ProvisionResult:
    """What :func:`provision` did: ``created``, ``updated`` (with ``changes``) or ``unchanged``.

    ``narrowed`` is True when this call replaced the old wildcard subject with the explicit
    partition subjects; ``strays`` are the stray messages the stream still holds after it
    (stored before it was narrowed; see :func:`purge_strays`)."""

    action: Literal["created", "updated", "unchanged"]
    stream: PartitionedStream
    changes: tuple[str, ...] = ()
    narrowed: bool = False
    strays: Strays | None = None


@dataclass(frozen=True)
class PartitionStats:
    partition: int
    subject: str
    messages: int
    last_seq: int


def _from_info(info: api.StreamInfo, *, check_layout: bool = True) -> PartitionedStream:
    cfg = info.config
    meta = cfg.metadata or {}
    name = cfg.name or "?"
    if META_PARTITIONS not in meta:
        raise StreamConflictError(
            f"stream {name} exists but is not a partitioned stream (no {META_PARTITIONS!r} in its "
            "metadata); it was not created by nats-ordered. Use another stream name, or delete "
            f"{name} if it is not needed."
        )
    try:
        partitions = int(meta[META_PARTITIONS])
        seed = int(meta.get(META_SEED, "0"))
    except ValueError as exc:
        raise StreamConflictError(
            f"stream {name} has malformed partition metadata {meta!r}: {exc}"
        ) from exc
    hash_name = meta.get(META_HASH, "")
    if hash_name != HASH_NAME or seed != HASH_SEED:
        raise StreamConflictError(
            f"stream {name} was partitioned with hash {hash_name!r} seed {seed}, but this "
            f"version uses {HASH_NAME!r} seed {HASH_SEED}; keys would land on other partitions"
        )
    prefix = meta.get(META_PREFIX) or ""
    try:
        epoch, layouts = read_layouts(meta, prefix)
    except (ValueError, KeyError, TypeError) as exc:
        raise StreamConflictError(
            f"stream {name} has malformed layout metadata {meta!r}: {exc}"
        ) from exc
    current = Layout(epoch, max(1, partitions), prefix)
    explicit = sorted(cfg.subjects or []) == sorted(current.subjects)
    if check_layout:
        _check_layout(name, prefix, cfg.subjects or [], current)
    return PartitionedStream(
        name=name,
        prefix=prefix,
        partitions=partitions,
        hash_name=hash_name,
        seed=seed,
        replicas=cfg.num_replicas or 1,
        storage="memory" if cfg.storage == api.StorageType.MEMORY else "file",
        duplicate_window=float(cfg.duplicate_window or 0),
        max_msg_size=cfg.max_msg_size if cfg.max_msg_size is not None else -1,
        allow_batched=bool(cfg.allow_batched),
        config=cfg,
        created=info.created.isoformat() if info.created else "",
        explicit_subjects=explicit,
        epoch=epoch,
        layouts=layouts,
        current_epoch=epoch,
    )


def _check_layout(name: str, prefix: str, subjects: list[str], current: Layout) -> None:
    """Refuse (:class:`LayoutMismatchError`) a stream whose partition subjects are not its
    metadata's layout: one that takes a partition subject of another layout (another
    count or epoch), or lacks one of its own. A stream on the wildcard ``<prefix>.p.*``
    (created before the explicit list) and subjects that are no partition subjects at
    all are left to :func:`provision` and the stray report."""
    if f"{prefix}.p.*" in subjects:
        return
    taken = sorted(s for s in subjects if is_partition_subject(prefix, s))
    if taken == sorted(current.subjects):
        return
    shape = subjects_layout(prefix, taken)
    if not taken:
        held = "none of its partition subjects"
    elif shape is not None:
        held = (
            f"{Layout(shape[0], shape[1], prefix).subject(0)} to "
            f"{Layout(shape[0], shape[1], prefix).subject(shape[1] - 1)} (the {shape[1]} "
            f"partition subjects of layout epoch {shape[0]})"
        )
    else:
        more = " ..." if len(taken) > 4 else ""
        held = f"{len(taken)} partition subjects ({', '.join(taken[:4])}{more})"
    if shape is None or shape[0] < current.epoch:
        fix = (
            "A repartition was interrupted, or the stream was edited by hand: complete it "
            f"with `nats-ordered repartition --stream {name} --partitions "
            f"{current.partitions}` (it sets the subjects to the metadata's layout and records "
            "the switch point)"
        )
    else:  # the same epoch with another count: no repartition wrote this
        fix = (
            "The stream was edited by hand: set its subjects, or its metadata "
            f"{META_PARTITIONS!r}, back to the layout its records were published by (`nats "
            f"stream edit {name} ...`); change the count with `nats-ordered repartition`"
        )
    raise LayoutMismatchError(
        f"stream {name}'s metadata says {current.partitions} partitions in layout epoch "
        f"{current.epoch} ({current.subject(0)} to {current.subject(current.partitions - 1)}) "
        f"but the stream takes {held}: its subjects and its metadata disagree, so publishers, "
        "workers and `info` would each follow another layout, and nothing is published or "
        f"processed until they agree. {fix}"
    )


async def describe(nc: NATS, name: str, *, check_layout: bool = True) -> PartitionedStream:
    """Read a partitioned stream's contract (P, prefix, hash) from the server. A name no
    partitioned stream can have is refused (ConfigError) before asking the server; a stream
    whose partition subjects are not its metadata's layout (:class:`LayoutMismatchError`,
    naming the command that completes the change) unless ``check_layout`` is False (only
    :mod:`.repartition` reads it so, to complete the change)."""
    check_stream_name(name)
    js = jetstream(nc)
    try:
        info = await js.stream_info(name)
    except NotFoundError as exc:
        raise StreamNotFoundError(
            f"stream {name} does not exist; create it with "
            f"`nats-ordered provision --stream {name} --partitions N`"
        ) from exc
    return _from_info(info, check_layout=check_layout)


async def _overlapping_streams(nc: NATS, subject: str, exclude: str) -> list[str]:
    resp = await nc.request(
        api_subject(nc, "STREAM.NAMES"), json.dumps({"subject": subject}).encode(), timeout=5
    )
    names = json.loads(resp.data).get("streams") or []
    return [n for n in names if n != exclude]


def _safe_changes(spec: StreamSpec, current: api.StreamConfig) -> list[tuple[str, Any, Any]]:
    want = spec.stream_config()
    fields = [
        "max_age",
        "max_bytes",
        "max_msgs",
        "max_msg_size",
        "duplicate_window",
        "description",
        "num_replicas",
        "allow_batched",
        "allow_direct",
    ]
    out = []
    for f in fields:
        a, b = getattr(current, f), getattr(want, f)
        if f == "description":
            a, b = a or None, b or None
        elif f in ("max_age", "duplicate_window"):
            a, b = float(a or 0), float(b or 0)
        elif f in ("allow_batched", "allow_direct"):
            a, b = bool(a), bool(b)
        if a != b:
            out.append((f, a, b))
    return out


async def provision(nc: NATS, spec: StreamSpec) -> ProvisionResult:
    """Create the stream, or verify an existing one and apply safe changes.

    Idempotent: running it again with the same spec changes nothing. Refuses (with what
    differs and what to do) a different partition count, prefix or storage, and subjects
    that overlap another stream. Applies retention limits, duplicate window, description,
    replicas and the batch/direct flags in place.
    """
    js = jetstream(nc)
    admin = jetstream(nc, timeout=PROVISION_TIMEOUT)
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        info = None

    if info is None:
        _check_request_size(nc, spec)
        # the wildcard probe: any stream on <prefix>.p.<anything> would share the namespace
        others = await _overlapping_streams(nc, partition_wildcard(spec.prefix), spec.name)
        if others:
            raise StreamConflictError(
                f"cannot create stream {spec.name}: its subjects "
                f"({subjects_text(spec.prefix, spec.partitions)}) overlap stream(s) "
                f"{', '.join(others)}; choose another subject prefix (subject_prefix=, CLI "
                "--subject-prefix) or stream name"
            )
        return ProvisionResult("created", _from_info(await _add_stream(admin, spec)))

    current = _from_info(info)
    problems = []
    if current.partitions != spec.partitions:
        problems.append(
            f"stream {spec.name} has {current.partitions} partitions in its metadata but "
            f"{spec.partitions} were requested; the partition count cannot change in place "
            "(keys would move to other partitions and lose their order): change it with "
            f"`nats-ordered repartition --stream {spec.name} --partitions {spec.partitions}` "
            "(Airflow: NatsRepartitionStreamOperator; it keeps every key's order across the "
            f"switch), or request partitions={current.partitions} (CLI: --partitions "
            f"{current.partitions})"
        )
    if current.prefix != spec.prefix:
        problems.append(
            f"stream {spec.name} uses subject prefix {current.prefix!r} but {spec.prefix!r} "
            f"was requested; pass subject_prefix={current.prefix!r} (CLI: --subject-prefix "
            f"{current.prefix}) or use another stream name"
        )
    if current.storage != spec.storage:
        problems.append(
            f"stream {spec.name} uses {current.storage} storage but {spec.storage} was "
            "requested; storage cannot change in place"
        )
    # a repartitioned stream's subjects are those of its current layout
    allowed = {*spec.subjects, partition_wildcard(spec.prefix)}
    if current.epoch:
        allowed = set(current.layout.subjects)
    foreign = [s for s in info.config.subjects or [] if s not in allowed]
    if foreign and not problems:
        problems.append(
            f"stream {spec.name} also takes subjects that are not partition subjects: "
            f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}. Provision would "
            "stop accepting them; if nothing publishes there any more, set the stream's "
            f"subjects to {subjects_text(spec.prefix, spec.partitions)} (e.g. `nats stream "
            f"edit {spec.name} --subjects ...`) or remove the extra ones, then run it again"
        )
    if problems:
        exc_type = (
            PartitionMismatchError if current.partitions != spec.partitions else StreamConflictError
        )
        raise exc_type("; ".join(problems))

    changes = [f"{f}: {_fmt(a)} -> {_fmt(b)}" for f, a, b in _safe_changes(spec, info.config)]
    narrowed = not current.explicit_subjects
    if narrowed:
        was = info.config.subjects or []
        how = "narrowed" if partition_wildcard(spec.prefix) in was else "set"
        changes.insert(
            0,
            f"subjects: {', '.join(was[:3]) or '(none)'}{', ...' if len(was) > 3 else ''} -> "
            f"{subjects_text(spec.prefix, spec.partitions)} ({how}: the server now refuses "
            "publishes to any other subject)",
        )
    if not changes:
        return ProvisionResult("unchanged", current, strays=await stray_messages(nc, current))
    _check_request_size(nc, spec)
    new_cfg = spec.stream_config()
    if current.epoch:
        new_cfg.subjects = current.layout.subjects
    # keep metadata the server added (e.g. _nats.* API levels) alongside ours
    merged = dict(info.config.metadata or {})
    merged.update(new_cfg.metadata or {})
    new_cfg.metadata = merged
    try:
        updated = _from_info(await admin.update_stream(new_cfg))
    except APIError as exc:
        raise StreamConflictError(
            f"cannot update stream {spec.name} ({', '.join(c.split(':')[0] for c in changes)}): "
            f"{exc.description}"
        ) from exc
    return ProvisionResult(
        "updated",
        updated,
        tuple(changes),
        narrowed=narrowed,
        strays=await stray_messages(nc, updated),
    )


def _check_request_size(nc: NATS, spec: StreamSpec) -> None:
    """Refuse a configuration the server would not take in one request (it lists every
    partition subject, so a long prefix times many partitions can pass max_payload)."""
    size = len(json.dumps(spec.stream_config().as_dict()).encode())
    limit = nc.max_payload or 0
    if limit and size > limit:
        raise ConfigError(
            f"stream {spec.name}'s configuration lists its {spec.partitions} partition subjects "
            f"({spec.prefix}.p.<n>) and is {size} bytes, more than the server's max_payload "
            f"({limit} bytes): use a shorter subject prefix (subject_prefix=, CLI "
            "--subject-prefix) or fewer "
            "partitions, or raise max_payload in the server configuration"
        )


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}s"
    return repr(v)


#: how long creating a replicated stream waits for the cluster to place it: the servers of a
#: cluster that has just started tell the meta leader what they can hold within seconds,
#: and until then it answers "no suitable peers for placement"
PLACEMENT_WAIT = 10.0


async def _add_stream(admin: Any, spec: StreamSpec) -> Any:
    """Create the stream; a placement refusal is retried for :data:`PLACEMENT_WAIT` seconds
    (a cluster still forming), then reported with what to change."""
    deadline = asyncio.get_running_loop().time() + PLACEMENT_WAIT
    while True:
        try:
            return await admin.add_stream(spec.stream_config())
        except APIError as exc:
            text = exc.description or str(exc)
            placement = "no suitable peers" in text
            if placement and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.25)
                continue
            hint = (
                f" (for {PLACEMENT_WAIT:g}s): fewer servers of the cluster can hold it than "
                f"replicas={spec.replicas} (CLI: --replicas {spec.replicas}), or they lack "
                "storage; lower the replicas or add servers"
                if placement
                else ""
            )
            raise StreamConflictError(f"cannot create stream {spec.name}: {text}{hint}") from exc


async def partition_stats(nc: NATS, stream: PartitionedStream | str) -> list[PartitionStats]:
    """Per-partition message count and last stream sequence (0 for an empty partition)."""
    return (await stream_contents(nc, stream)).partitions


async def stream_contents(nc: NATS, stream: PartitionedStream | str) -> StreamContents:
    """Each partition's message count and last sequence, and the stray messages, from one
    stream-info read of every stored subject (plus one last-message read per non-empty
    partition). Stray counts come from the same read as the partitions', so a message
    stored or removed meanwhile never shows up as a stray."""
    if isinstance(stream, str):
        stream = await describe(nc, stream)
    js = jetstream(nc)
    info = await js.stream_info(stream.name, subjects_filter=">")
    counts = info.state.subjects or {}
    strays = _strays_in(stream, counts)

    async def last(p: int) -> int:
        subj = stream.subject(p)
        if not counts.get(subj):
            return 0
        try:
            msg = await js.get_last_msg(stream.name, subj, direct=True)
        except NotFoundError:
            return 0
        return int(msg.seq or 0)

    lasts = await asyncio.gather(*(last(p) for p in range(stream.partitions)))
    stats = [
        PartitionStats(p, stream.subject(p), int(counts.get(stream.subject(p), 0)), lasts[p])
        for p in range(stream.partitions)
    ]
    return StreamContents(stats, strays)


async def stray_messages(nc: NATS, stream: PartitionedStream) -> Strays:
    """The stream's stray messages, from one stream-info read (no per-partition reads)."""
    info = await jetstream(nc).stream_info(stream.name, subjects_filter=">")
    return _strays_in(stream, info.state.subjects or {})


def _strays_in(stream: PartitionedStream, counts: Mapping[str, int]) -> Strays:
    """The strays among a stream's per-subject counts (every stored subject)."""
    return Strays(
        stream.name,
        stream.partitions,
        {s: int(n) for s, n in sorted(counts.items()) if n and not _layout_subject(stream, s)},
        accepting=not stream.explicit_subjects,
    )


def _layout_subject(stream: PartitionedStream, subject: str) -> bool:
    """True when ``subject`` is a partition subject of the stream's current layout or of
    an earlier one (messages of an earlier layout are read by groups that have not yet
    passed its switch; they are no strays)."""
    cur = stream.at_epoch(stream.current_epoch)
    return any(
        partition_of(stream.prefix, lay.epoch, lay.partitions, subject) is not None
        for lay in (*stream.layouts, cur.layout)
    )


async def purge_strays(nc: NATS, stream: PartitionedStream | str) -> Strays:
    """Remove every stray message; returns what was removed. The partitions are untouched:
    each purge names one stray subject (a literal subject, never a wildcard). Narrow the
    stream first (:func:`provision`), or new strays may arrive right after."""
    if isinstance(stream, str):
        stream = await describe(nc, stream)
    strays = await stray_messages(nc, stream)
    js = jetstream(nc)
    for subject in strays.subjects:
        await js.purge_stream(strays.stream, subject=subject)
    return strays


async def partition_bounds(nc: NATS, stream: PartitionedStream, partition: int) -> tuple[int, int]:
    """The stream sequences of the first and the last message of ``partition`` still in the
    stream, read from the stream leader; ``(0, 0)`` for an empty partition."""
    js = jetstream(nc)
    subject = stream.subject(partition)
    try:
        first = await js.get_msg(stream.name, seq=1, subject=subject, next=True)
        last = await js.get_last_msg(stream.name, subject)
    except NotFoundError:
        return 0, 0
    return int(first.seq or 0), int(last.seq or 0)
