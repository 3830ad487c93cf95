"""Resuming a routed Spark run after what an earlier attempt stored, only on the same input.

A routed run (rows carrying ``nats_partition``, as :func:`~.routing.route` makes them) numbers
each NATS partition's rows 1, 2, ... in input order, and a re-run passes over the positions an
earlier attempt stored. That is exact only if the re-run reads the *same* rows in the same
order: a row refused before (no key, too large) and corrected since takes a position it did
not have, every later row of its partition moves up one, and passing over the first n
positions would lose one row and store another twice.

So every attempt keeps, per partition, a digest of the msg-ids of its positions in order
(a msg-id covers the producer id, the row's rank among the run's rows of its key, its key
and payload, or is the ``msgIdColumn``): the ledger records ``"<n>:<digest>"`` with each
run's counts (:attr:`RunRecord.prefix_digests`), and a resume computes the same digest
over the rows it passes over. Where they differ, or where the partition's last stored
message (read from the stream) is not the row now at its position, or the input now has
fewer rows there, the task fails with :class:`InputChangedError` before it sends a row of
that partition, naming the fix: the original input, or a new ``producerId``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_nats_ordered.core.errors import NatsOrderedError, RecordError
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.msg_ids import (
    msg_id_at,
    msg_id_base,
)
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.tails import StoredTail, read_tails
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.spark.headers import BadHeaders

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from airflow_nats_ordered.core.publish.runs import RunRecord


class InputChangedError(NatsOrderedError):
    """A resumed run's input is not the input its earlier attempt stored rows of."""


@dataclass(frozen=True)
class PartitionResume:
    """Where one NATS partition of a run resumes, and what must hold for it to be exact.

    ``count``: leading positions stored by earlier attempts (passed over, unsent);
    ``digest_at``/``digest``: the digest of positions 1..digest_at an earlier attempt
    recorded; ``last_at``/``last_id``: the msg-id the stream holds at position ``last_at``
    (the partition's last message, when it is this run's)."""

    count: int
    digest_at: int = 0
    digest: str = ""
    last_at: int = 0
    last_id: str = ""


def parse_digest(value: str) -> tuple[int, str]:
    """``"<n>:<hex>"`` -> ``(n, hex)``; ``(0, "")`` for anything else."""
    n, _, hexdigest = value.partition(":")
    return (int(n), hexdigest) if n.isdigit() and hexdigest else (0, "")


def resume_points(
    previous: RunRecord | None, stored: Mapping[int, tuple[int, str]] | None = None
) -> dict[int, PartitionResume]:
    """Per partition, where a routed run resumes: after what the ledger recorded
    (``previous``) or what the stream holds (``stored``: partition -> (position, msg-id) of
    its last message, when that message is this run's), whichever is further."""
    stored = stored or {}
    acked = dict(previous.acked_per_partition) if previous is not None else {}
    digests = dict(previous.prefix_digests) if previous is not None else {}
    out: dict[int, PartitionResume] = {}
    for p in set(acked) | set(stored):
        last_at, last_id = stored.get(p, (0, ""))
        count = max(acked.get(p, 0), last_at)
        if not count:
            continue
        at, digest = parse_digest(digests.get(p, ""))
        if at > count:  # cannot happen with one input; check what can be checked
            at, digest = 0, ""
        out[p] = PartitionResume(count, at, digest, last_at, last_id)
    return out


async def stored_tails(nc: NATS, stream: str, producer_id: str) -> dict[int, StoredTail]:
    """Per partition with messages, its last message (:class:`StoredTail`), as the core's
    ``publish_run`` reads them to resume after an attempt that died before recording its
    progress (:func:`~airflow_nats_ordered.core.publish.tails.read_tails`)."""
    return await read_tails(nc, await describe(nc, stream), producer_id)


def own_positions(
    tails: Mapping[int, StoredTail], after: Mapping[int, int] | None = None
) -> dict[int, tuple[int, str]]:
    """``stored`` for :func:`resume_points`: partitions whose last message is the run's
    (and, with ``after``, was stored after that stream sequence of its partition)."""
    after = after or {}
    return {
        p: (t.position, t.msg_id)
        for p, t in tails.items()
        if t.position and t.seq > after.get(p, 0)
    }


_core_publish = OrderedPublisher.publish


class ResumingPublisher(OrderedPublisher):
    """The core publisher, passing over ``resume``'s positions only while they hold the same
    rows, and keeping per partition the digest of its positions (:meth:`digests`).

    Routed rows' derived msg-ids (``track``) are of the row's *rank among the run's rows of
    its key* (``docs/protocol.md`` section 6's place in the input): every row of a key is in
    one NATS partition, so in one task, sorted by the write's order and tie-breaker, whatever
    the stream's partition count, Spark's partitioning or the attempt; keyless rows are
    ranked among the task's keyless rows (routing puts every keyless row in one task). The
    per-key counts are kept for one NATS partition at a time (a routed task receives its
    rows partition by partition, which :class:`~.records.RoutingCheck` enforces): memory
    is one entry per distinct key of the partition being published (about 100 bytes plus
    the key's length each).

    A check fails on the row at the checked position, which is passed over like the rows
    before it: nothing of that partition is sent after a changed prefix."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        config: PublisherConfig,
        *,
        resume: Mapping[int, PartitionResume],
        run: str,
        label: str,
        track: bool = True,
        stored_at_start: Mapping[int, int] | None = None,
        fence: Mapping[int, int] | None = None,
    ) -> None:
        super().__init__(
            nc,
            stream,
            config,
            start_after={p: r.count for p, r in resume.items() if r.count},
            fence=fence,
        )
        self.resume = dict(resume)
        self.run = run
        self.label = label
        #: number positions and keep digests (routed rows); unrouted rows need neither
        self.track = track
        #: per partition, the positions stored when the job began (the driver's resume
        #: points); a stored position past it was stored by this job (None: not known)
        self.stored_at_start = stored_at_start
        self._producer = self.producer_id.encode()
        self._positions: dict[int, int] = {}
        self._hashes: dict[int, Any] = {}
        #: the msg-ids' digest of the producer id (msg_id_base)
        self._base = msg_id_base(self._producer)
        #: key bytes -> rows of that key so far, for the NATS partition ``_ranked`` only
        self._ranks: dict[bytes, int] = {}
        self._ranked: int | None = None
        self._keyless = 0  # keyless rows so far

    async def publish(
        self,
        key: str | bytes | None,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        index: int | None = None,
        partition: int | None = None,
        rank: int | None = None,
    ) -> int:
        """The core's ``publish``; ``partition``: the row's NATS partition when the caller
        has checked it is the key's (a ``nats_partition`` column). Routed rows' derived
        msg-ids are computed here, of the row's rank among its key's rows (every row handed
        over takes one, also a refused one; ``rank``: the rank the row carries, counted
        over the whole input, when rows were taken out before, see
        :mod:`.repartitioned`), and handed to the core."""
        if not self.track:
            if isinstance(headers, BadHeaders):  # refused (counted, reported)
                raise RecordError(headers.reason)
            return await super().publish(key, data, msg_id=msg_id, headers=headers, index=index)
        if msg_id is None:
            if key:
                kb = key.encode() if isinstance(key, str) else bytes(key)
                if partition is not None and partition != self._ranked:
                    self._ranks.clear()  # a key's rows are all in one NATS partition
                    self._ranked = partition
                if rank is None:
                    rank = self._ranks.get(kb, 0) + 1
                self._ranks[kb] = rank
            else:
                kb = b""
                self._keyless += 1
                rank = self._keyless
            line = msg_id_at(self._base, rank, kb, data)  # the derived msg-id (core's rule)
            mid = line.decode()
        else:
            mid = msg_id
            line = mid.encode()
        if isinstance(headers, BadHeaders):  # refused (counted, reported), takes no position
            raise RecordError(headers.reason)
        # raises for a refused record, which takes no position (the core's publish, without a
        # super() per row)
        part = await _core_publish(self, key, data, msg_id=mid, headers=headers, index=index)
        if partition is not None and key and part != partition:  # RoutingCheck compared them
            raise RuntimeError(f"key {key!r} went to partition {part}, not {partition}")
        pos = self._positions.get(part, 0) + 1
        self._positions[part] = pos
        h = self._hashes.get(part)
        if h is None:
            h = self._hashes[part] = hashlib.blake2b(digest_size=16)
        h.update(line + b"\n")
        r = self.resume.get(part)
        if r is not None and pos <= r.count:
            if pos == r.digest_at and h.hexdigest() != r.digest:
                self._changed(
                    part, r, f"the rows at positions 1-{pos} differ from those stored", pos
                )
            if pos == r.last_at and r.last_id and mid != r.last_id:
                self._changed(
                    part,
                    r,
                    f"the row at position {pos} (the last one stored) differs from it",
                    pos,
                )
        return part

    def rank_rows(
        self,
        keys: Sequence[str | bytes | None],
        parts: Sequence[int | None],
        ranks: Sequence[int | None],
    ) -> list[int]:
        """The places of a batch of routed rows in the run's input, as :meth:`publish`
        takes them row by row: each row's rank among its key's rows (keyless rows: among
        the keyless rows), also for a row the core refuses afterwards."""
        counts, keyless, ranked = self._ranks, self._keyless, self._ranked
        out: list[int] = []
        append = out.append
        get = counts.get
        for key, part, rank in zip(keys, parts, ranks, strict=True):
            if key:
                kb = key.encode() if key.__class__ is str else bytes(key)  # type: ignore[arg-type]
                if part is not None and part != ranked:
                    counts.clear()  # a key's rows are all in one NATS partition
                    get = counts.get
                    ranked = part
                if rank is None:
                    rank = get(kb, 0) + 1
                counts[kb] = rank
            else:
                keyless += 1
                rank = keyless
            append(rank)
        self._keyless, self._ranked = keyless, ranked
        return out

    def resuming(self, parts: Iterable[int | None]) -> bool:
        """Whether any of ``parts`` has positions to pass over or check (:meth:`publish`
        then checks them row by row)."""
        return bool(self.resume) and any(p in self.resume for p in set(parts))

    async def publish_routed(
        self,
        keys: Sequence[str | bytes | None],
        payloads: Sequence[bytes],
        parts: Sequence[int | None],
        ranks: Sequence[int | None],
        refused: Callable[[int, RecordError], None],
    ) -> None:
        """:meth:`publish` for a batch of routed rows without headers or caller msg-ids, in
        NATS partitions with nothing to pass over (see :meth:`resuming`): the rows' places
        (:meth:`rank_rows`) go to the core's ``publish_placed``, which derives each msg-id
        as ``publish(..., index=rank)`` does (the same id the row-by-row path derives and
        hands over) and gives the ids back, and positions and digests are kept per run of
        one partition's rows rather than per row (the same digests: the msg-ids of the
        accepted rows, in order). ``refused(i, error)`` is called for row ``i`` the core
        refuses (it takes no position)."""
        places = self.rank_rows(keys, parts, ranks)
        ids: list[bytes] = []
        got: list[int] = []
        out: list[int] = []  # the refused rows

        def refuse(i: int, exc: RecordError) -> None:
            out.append(i)
            refused(i, exc)

        try:
            await self.publish_placed(keys, payloads, places, ids=ids, parts=got, refused=refuse)
        finally:
            self._keep(keys, parts, ids, got, out)

    def _keep(
        self,
        keys: Sequence[str | bytes | None],
        parts: Sequence[int | None],
        ids: list[bytes],
        got: list[int],
        refused: list[int],
    ) -> None:
        """Positions and digests of the rows ``publish_placed`` took (partitions ``got``,
        msg-ids ``ids``), per run of one partition's rows; each keyed row's partition
        checked against its ``nats_partition`` (``parts``)."""
        n = len(got)
        if not n:
            return
        expect = list(parts)
        if refused:
            gone = set(refused)
            expect = [p for i, p in enumerate(expect) if i not in gone]
            keys = [k for i, k in enumerate(keys) if i not in gone]
        if got != expect:  # a keyless row's partition is round-robin: check keyed rows
            for key, part, want in zip(keys, got, expect, strict=True):
                if key and part != want:  # RoutingCheck compared them
                    raise RuntimeError(f"key {key!r} went to partition {part}, not {want}")
        positions, hashes = self._positions, self._hashes
        first = got[0]
        if got.count(first) == n:  # the common batch: one partition's rows
            runs = [(first, 0, n)]
        else:
            runs = []
            start = 0
            for j in range(1, n):
                if got[j] != got[j - 1]:
                    runs.append((got[start], start, j))
                    start = j
            runs.append((got[start], start, n))
        for part, lo, hi in runs:
            positions[part] = positions.get(part, 0) + hi - lo
            h = hashes.get(part)
            if h is None:
                h = hashes[part] = hashlib.blake2b(digest_size=16)
            h.update(b"\n".join(ids[lo:hi]) + b"\n")

    def check_prefixes_read(self) -> None:
        """At the end of the task's input: every partition it holds had at least its stored
        positions (fewer rows there now means the input changed). A partition with no rows
        left at all is in no task: :func:`vanished` finds it on the driver."""
        for p, have in sorted(self._positions.items()):
            r = self.resume.get(p)
            if r is not None and have < r.count:
                self._changed(p, r, f"only {have} of its rows are in the input now", r.count)

    def digests(self) -> dict[int, str]:
        """Per partition this publisher numbered rows of: ``"<n>:<digest of positions 1..n>"``."""
        return {p: f"{self._positions[p]}:{h.hexdigest()}" for p, h in self._hashes.items()}

    def _changed(self, p: int, r: PartitionResume, what: str, at: int) -> None:
        """Refuse partition ``p``: the stored position ``at`` does not hold this input's row.
        Past what was stored when the job began, another task of this job stored it."""
        start = self.stored_at_start
        if start is not None and at > start.get(p, 0):
            raise InputChangedError(
                f"{self.label}: rows of NATS partition {p} were stored by this job already "
                f"(run {self.run!r}, {r.count} rows), and {what}: the partition's rows are in "
                "more than one Spark task (a nats_partition column with the right values "
                "does not put each partition in one task: route with "
                "airflow_nats_ordered.spark.write_ordered or route()), or an earlier attempt "
                "of this task read different rows (a non-deterministic input: cache or "
                "checkpoint it before writing). Nothing more of that partition was sent; "
                "publish under a new producerId (write_ordered: producer_id): the rows this "
                "run stored there are not one task's order, so it cannot resume them"
            )
        raise InputChangedError(
            f"{self.label}: run {self.run!r} cannot resume because its input changed: an "
            f"earlier attempt stored {r.count} rows of NATS partition {p}, but {what}. A run "
            "resumes only the input it started with (passing over changed rows would lose "
            "some and store others twice), so nothing more of that partition was sent. "
            "Re-run it with the input it read before (rows refused then are refused again; "
            "allowRefused=true publishes the rest), or publish the corrected input under a "
            "new producerId (write_ordered: producer_id); its rows are then stored again, "
            "after this run's"
        )


def vanished(resume: Mapping[int, PartitionResume], seen: set[int], run: str) -> str | None:
    """The driver's half of :meth:`ResumingPublisher.check_prefixes_read`: the error for
    partitions an earlier attempt stored rows of that no task had a row of, or None."""
    gone = sorted(p for p, r in resume.items() if r.count and p not in seen)
    if not gone:
        return None
    return (
        f"run {run!r}: its input changed: earlier attempts stored rows of NATS partition(s) "
        f"{gone}, which have no rows in the input now. A run resumes only the input it "
        "started with: re-run it with that input, or publish the new input under a new "
        "producerId (write_ordered: producer_id)"
    )
