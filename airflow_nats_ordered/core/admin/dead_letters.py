"""Administering a group's dead letters: reading, replaying and purging them (what
``nats stream view`` and DLQ tools do, for the records of ``<STREAM>_DLQ``).

A dead letter (:mod:`..worker.dead_letters`) is the original record (payload and every header)
plus ``Nats-Ordered-Error`` (why) and ``Nats-Ordered-Origin`` (stream, group, partition,
sequence, fencing token), stored on ``<prefix>.dlq.<group>.<partition>`` of ``<STREAM>_DLQ``.

Guarantees of a replay (:func:`replay_dead_letters`):

* A record goes back to the partition its key hashes to (the partition it came from,
  unless it was dead-lettered as misrouted: then to the right one), or to its original
  partition when keyless. A record whose key header cannot be decoded is refused (it
  cannot be routed; give a subject). It is published with its payload and key header
  exactly, so the worker's routing check accepts it.
* Records are published one at a time in the order they were first stored (their
  original stream sequence), each acknowledged before the next: records replayed into
  one partition keep their order. They land after everything stored in the partition
  since: a replay is new input, not a rewind (to re-process in place, reset the group).
* Each replay carries a fresh ``Nats-Msg-Id`` derived from the original record (stream,
  sequence, group, msg-id), not the original's, which the server would drop as a
  duplicate inside the window. So a replay that is retried, or run twice, inside the
  stream's duplicate window stores each record once (reported as ``duplicate``).
* The original producer headers (``Nats-Ordered-Producer``, ``Nats-Ordered-Seq``) are
  dropped, so a resumed publish run never takes a replay for one of its own records, and
  ``Nats-Ordered-Error``/``Nats-Ordered-Origin`` become ``Nats-Ordered-Replay-Of`` (the
  origin, with the dead letter's sequence): the handler can tell a replay.
* With ``purge=True`` a dead letter is removed only once its replay is acknowledged.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, NotFoundError

from airflow_nats_ordered.core.admin.dlq import dead_letter_prefix, dead_letter_stream
from airflow_nats_ordered.core.admin.listing import find_groups
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError
from airflow_nats_ordered.core.connection.api import api_subject, jetstream
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.msg_ids import HDR_MSG_ID, HDR_PRODUCER, HDR_SEQ
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, describe
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.stream.routing_check import route_key
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR, HDR_ORIGIN

HDR_REPLAY_OF = "Nats-Ordered-Replay-Of"
#: headers a replay does not carry over from the dead letter
_DROPPED = frozenset(h.lower() for h in (HDR_MSG_ID, HDR_PRODUCER, HDR_SEQ, HDR_ERROR, HDR_ORIGIN))


class DeadLetterNotFoundError(NatsOrderedError):
    """Dead letters asked for by sequence are not the group's (``seqs`` names them)."""

    def __init__(self, message: str, seqs: list[int]) -> None:
        super().__init__(message)
        self.seqs = seqs


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter as stored in ``<STREAM>_DLQ``."""

    seq: int
    subject: str
    time: dt.datetime | None
    headers: dict[str, str]
    data: bytes

    @property
    def origin(self) -> dict[str, Any]:
        """``Nats-Ordered-Origin``: stream, group, partition, seq, token ({} if absent)."""
        try:
            found = json.loads(self.headers.get(HDR_ORIGIN) or "{}")
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    @property
    def partition(self) -> int:
        """The partition it was read from (its origin, else its subject's last token)."""
        p = self.origin.get("partition")
        if isinstance(p, int):
            return p
        tail = self.subject.rsplit(".", 1)[-1]
        return int(tail) if tail.isdigit() else -1

    @property
    def origin_seq(self) -> int | None:
        seq = self.origin.get("seq")
        return seq if isinstance(seq, int) else None

    @property
    def reason(self) -> str:
        return self.headers.get(HDR_ERROR, "")

    @property
    def key(self) -> str | None:
        """Its key, byte-exact; None when keyless or when the key header cannot be decoded
        (see :attr:`key_problem`)."""
        return route_key(self.headers, 0, 1)[0]

    @property
    def key_problem(self) -> str | None:
        """Why its key header cannot be decoded, or None."""
        rejection = route_key(self.headers, 0, 1)[1]
        return rejection if rejection and rejection.startswith("malformed key") else None

    def to_dict(self, *, payload: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq": self.seq,
            "subject": self.subject,
            "time": self.time.isoformat() if self.time else None,
            "partition": self.partition,
            "origin_seq": self.origin_seq,
            "key": self.key,
            "key_problem": self.key_problem,
            "reason": self.reason,
            "origin": self.origin,
            "size": len(self.data),
        }
        if payload:
            out["headers"] = dict(self.headers)
            try:
                out["data"], out["data_encoding"] = self.data.decode(), "utf-8"
            except UnicodeDecodeError:
                out["data"], out["data_encoding"] = base64.b64encode(self.data).decode(), "base64"
        return out


@dataclass(frozen=True)
class DeadLetterPlace:
    """Where a group's dead letters are: the stream, its subject prefix (None: the stream
    does not exist yet) and the group's subject filter."""

    stream: str
    prefix: str | None
    group: str

    @property
    def exists(self) -> bool:
        return self.prefix is not None

    def subjects(self, partition: int | None = None) -> str:
        tail = "*" if partition is None else str(partition)
        return f"{self.prefix or '<prefix>'}.dlq.{self.group}.{tail}"


async def dead_letter_place(nc: NATS, stream: str, group: str) -> DeadLetterPlace:
    """Where ``group`` of ``stream`` keeps its dead letters. Raises GroupNotFoundError when
    the group has neither state nor dead letters (a typo in its name, most likely)."""
    GroupConfig(stream, group)  # a malformed name is refused before any request
    place = DeadLetterPlace(dead_letter_stream(stream), await dead_letter_prefix(nc, stream), group)
    if await _has_state(nc, stream, group):
        return place
    if place.exists:
        info = await jetstream(nc).stream_info(place.stream, subjects_filter=place.subjects())
        if info.state.subjects:
            return place
    known = [r.group for r in await find_groups(nc, stream)]
    raise GroupNotFoundError(
        f"group {group} of stream {stream} does not exist: it has no state and no dead "
        f"letters (groups of {stream}: {', '.join(known) or 'none'})",
        stream,
        group,
    )


async def _has_state(nc: NATS, stream: str, group: str) -> bool:
    try:
        await jetstream(nc).key_value(GroupConfig(stream, group).state_bucket)
    except (BucketNotFoundError, NotFoundError):
        return False
    return True


def _letter(msg: Any) -> DeadLetter:
    return DeadLetter(
        int(msg.seq or 0), msg.subject or "", msg.time, dict(msg.headers or {}), msg.data or b""
    )


async def read_dead_letters(
    nc: NATS,
    place: DeadLetterPlace,
    *,
    partitions: Sequence[int] | None = None,
    seqs: Sequence[int] | None = None,
    limit: int | None = None,
) -> list[DeadLetter]:
    """The group's dead letters in the order they were stored (of ``partitions`` only, if
    given), at most ``limit``; or exactly those at ``seqs`` (DeadLetterNotFoundError names
    every sequence that is not one of the group's dead letters)."""
    if not place.exists:
        if seqs:
            raise DeadLetterNotFoundError(_no_such(place, list(seqs)), list(seqs))
        return []
    js = jetstream(nc)
    prefix = f"{place.prefix}.dlq.{place.group}."
    if seqs:
        found, missing = [], []
        for seq in sorted(set(seqs)):
            try:
                msg = await js.get_msg(place.stream, seq=seq)
            except NotFoundError:
                missing.append(seq)
                continue
            if not (msg.subject or "").startswith(prefix):
                missing.append(seq)
                continue
            found.append(_letter(msg))
        if missing:
            raise DeadLetterNotFoundError(_no_such(place, missing), missing)
        return found
    only = sorted(set(partitions)) if partitions else None
    subject = place.subjects(only[0] if only and len(only) == 1 else None)
    out: list[DeadLetter] = []
    seq = 1
    while limit is None or len(out) < limit:
        try:
            msg = await js.get_msg(place.stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            break
        letter = _letter(msg)
        seq = letter.seq + 1
        if only is None or letter.partition in only:
            out.append(letter)
    return out


def _no_such(place: DeadLetterPlace, seqs: list[int]) -> str:
    shown = ", ".join(str(s) for s in seqs[:10]) + (", ..." if len(seqs) > 10 else "")
    return (
        f"no dead letter of group {place.group} at sequence {shown} of {place.stream}: list "
        "them with `nats-ordered dead-letters list` (sequences are the dead-letter stream's)"
    )


@dataclass(frozen=True)
class Replay:
    """Where one dead letter goes: its subject (None: refused, ``error`` says why)."""

    letter: DeadLetter
    subject: str | None
    partition: int | None
    msg_id: str
    error: str | None = None
    #: filled in by :func:`replay_dead_letters`: "stored", "duplicate" (already replayed
    #: inside the duplicate window) or "planned" (a dry run)
    outcome: str = "planned"
    stored_seq: int | None = None
    purged: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.letter.seq,
            "from_partition": self.letter.partition,
            "origin_seq": self.letter.origin_seq,
            "key": self.letter.key,
            "subject": self.subject,
            "partition": self.partition,
            "msg_id": self.msg_id,
            "outcome": self.outcome,
            "stored_seq": self.stored_seq,
            "purged": self.purged,
            "error": self.error,
        }


def replay_msg_id(letter: DeadLetter, group: str) -> str:
    """The replay's ``Nats-Msg-Id``: the same for every replay of one original record (so a
    retried replay stores it once), different from the original's."""
    o = letter.origin
    basis = "\x00".join(
        [
            str(o.get("stream", "")),
            group,
            str(o.get("seq", f"dlq{letter.seq}")),
            letter.headers.get(HDR_MSG_ID, "").split(":", 1)[-1],
        ]
    )
    return "replay-" + hashlib.blake2b(basis.encode(), digest_size=15).hexdigest()


def plan_replay(
    stream: PartitionedStream, group: str, letters: Iterable[DeadLetter], subject: str | None
) -> list[Replay]:
    """Where each letter would go, in replay order (original stream sequence)."""
    ordered = sorted(letters, key=lambda x: (x.origin_seq or 0, x.seq))
    out = []
    for letter in ordered:
        mid = replay_msg_id(letter, group)
        key, problem = letter.key, letter.key_problem
        home = partition_for(key, stream.partitions) if key is not None else None
        if subject is not None:
            error = None
            if subject.startswith(f"{stream.prefix}.p.") and problem is not None:
                error = (
                    f"cannot be routed: {problem}; {subject} is a partition of {stream.name}, "
                    "whose workers would reject it again: give a subject outside the stream"
                )
            elif subject.startswith(f"{stream.prefix}.p."):
                named = subject[len(stream.prefix) + 3 :]
                keyed_home = home if home is not None else letter.partition
                if named != str(keyed_home):
                    error = (
                        f"{subject} is partition {named} of {stream.name} but the record belongs "
                        f"to partition {keyed_home}: the worker would reject it as misrouted "
                        "(replay it without a subject, to its partition)"
                    )
            out.append(Replay(letter, None if error else subject, None, mid, error))
        elif problem is not None:
            out.append(
                Replay(
                    letter,
                    None,
                    None,
                    mid,
                    f"cannot be routed: {problem}; replay it to a subject of your choice",
                )
            )
        else:
            p = home if home is not None else letter.partition
            if not 0 <= p < stream.partitions:
                out.append(
                    Replay(letter, None, None, mid, f"its partition {p} is not in {stream.name}")
                )
            else:
                out.append(Replay(letter, stream.subject(p), p, mid))
    return out


def replay_headers(letter: DeadLetter, msg_id: str) -> dict[str, str]:
    """The headers a replay is published with (see the module's guarantees)."""
    headers = {k: v for k, v in letter.headers.items() if k.lower() not in _DROPPED}
    headers[HDR_MSG_ID] = msg_id
    headers[HDR_REPLAY_OF] = json.dumps({**letter.origin, "dead_letter": letter.seq})
    return headers


@dataclass
class ReplayResult:
    stream: str
    group: str
    replays: list[Replay] = field(default_factory=list)
    dry_run: bool = False

    @property
    def refused(self) -> list[Replay]:
        return [r for r in self.replays if r.error]


async def replay_dead_letters(
    nc: NATS,
    place: DeadLetterPlace,
    stream: str,
    letters: Sequence[DeadLetter],
    *,
    subject: str | None = None,
    purge: bool = False,
    dry_run: bool = False,
) -> ReplayResult:
    """Publish ``letters`` again, to their partition of ``stream`` or to ``subject`` (see
    the module's guarantees). Refuses (ConfigError) before publishing anything when any of
    them cannot be routed. ``dry_run``: plan only."""
    described = await describe(nc, stream)
    plan = plan_replay(described, place.group, letters, subject)
    refused = [r for r in plan if r.error]
    if refused and not dry_run:
        shown = "; ".join(f"dead letter {r.letter.seq}: {r.error}" for r in refused[:5])
        raise ConfigError(f"{len(refused)} dead letter(s) cannot be replayed, nothing was: {shown}")
    result = ReplayResult(stream, place.group, plan, dry_run)
    if dry_run:
        return result
    js = jetstream(nc)
    done = []
    for r in plan:
        assert r.subject is not None
        ack = await js.publish(
            r.subject,
            r.letter.data,
            stream=described.name if r.partition is not None else None,
            headers=replay_headers(r.letter, r.msg_id),
        )
        purged = False
        if purge:
            try:
                purged = await js.delete_msg(place.stream, r.letter.seq)
            except NotFoundError:
                purged = True  # removed meanwhile: what was asked for
        done.append(
            Replay(
                r.letter,
                r.subject,
                r.partition,
                r.msg_id,
                outcome="duplicate" if ack.duplicate else "stored",
                stored_seq=ack.seq,
                purged=purged,
            )
        )
    result.replays = done
    return result


@dataclass(frozen=True)
class Purged:
    stream: str
    group: str
    seqs: list[int]
    dry_run: bool


async def purge_dead_letters(
    nc: NATS,
    place: DeadLetterPlace,
    *,
    seqs: Sequence[int] | None = None,
    partitions: Sequence[int] | None = None,
    dry_run: bool = False,
) -> Purged:
    """Remove the group's dead letters at ``seqs``, or of ``partitions``, or all of them;
    other groups' dead letters are never touched. ``dry_run``: only say which."""
    if not place.exists:
        if seqs:
            raise DeadLetterNotFoundError(_no_such(place, list(seqs)), list(seqs))
        return Purged(place.stream, place.group, [], dry_run)
    letters = await read_dead_letters(nc, place, partitions=partitions, seqs=seqs)
    gone = [x.seq for x in letters]
    if dry_run or not gone:
        return Purged(place.stream, place.group, gone, dry_run)
    js = jetstream(nc)
    if seqs:
        for seq in gone:
            with contextlib.suppress(NotFoundError):  # removed meanwhile
                await js.delete_msg(place.stream, seq)
    else:
        last = max(gone)  # nothing stored after the read is removed
        for p in sorted({x.partition for x in letters}) if partitions else [None]:
            await _purge_upto(nc, place.stream, place.subjects(p), last + 1)
    return Purged(place.stream, place.group, gone, dry_run)


async def _purge_upto(nc: NATS, stream: str, subject: str, keep_from: int) -> None:
    """Purge ``subject`` below sequence ``keep_from`` (the JetStream ``seq`` purge)."""
    resp = await nc.request(
        api_subject(nc, f"STREAM.PURGE.{stream}"),
        json.dumps({"filter": subject, "seq": keep_from}).encode(),
        timeout=5.0,
    )
    body = json.loads(resp.data or b"{}")
    if "error" in body:
        raise NatsOrderedError(
            f"purging {subject} of {stream} failed: {body['error'].get('description')}"
        )
