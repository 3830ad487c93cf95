"""A global-order reader's durable position (:class:`GlobalPosition`): key ``global`` in its
group's state bucket, written by compare-and-set and fenced like a partition's commit.

Guarantees: :meth:`GlobalPositions.grant` bumps the fencing token by compare-and-set
(:func:`~.commits.next_token`), so once a newer reader of the group has started, every
write of an older one fails with :class:`~.commits.Fenced`. A position that existed and
was deleted is never taken for "start from the beginning" (:class:`GlobalPositionMissing`);
a position recorded for another incarnation of the stream is refused
(:class:`~.stream_identity.StreamRecreated`). A failed compare-and-set whose current record
is exactly what this reader wrote is the lost reply of an applied write, and is adopted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.commits import Fenced, next_token
from airflow_nats_ordered.core.group.stream_identity import StreamRecreated
from airflow_nats_ordered.core.stream.kv import compact_json, latest_entry

#: the key of the position in the group's state bucket
POSITION_KEY = "global"

#: the key of a running reader's heartbeat in the group's lease bucket (whose TTL expires
#: it when the reader dies); per-key workers list members by ``m.<id>`` only, so they
#: never take a global-order reader for one of theirs
READER_KEY = "global"


class GlobalPositionMissing(NatsOrderedError):
    """The group's global position was deleted although it existed: resuming from the
    beginning would hand everything over again, so the reader refuses."""


@dataclass(frozen=True)
class GlobalPosition:
    """``g``: the last global sequence handed over (0: none); ``seqs``: per partition the
    stream sequence of its last record handed over (absent: none yet); ``late``: records
    the time-window mode found late so far (``status`` shows it); ``ts``: wall-clock time
    of the write (seconds since the epoch; 0 when read from an older record)."""

    g: int = 0
    seqs: dict[int, int] = field(default_factory=dict)
    token: int = 0
    member: str = ""
    stream: str = ""
    late: int = 0
    ts: float = 0.0
    #: what ``g`` counts: ``sequence`` (``Nats-Global-Seq``), ``time`` (the time-window
    #: mode: the stored time in ns of the last record handed over) or ``event-time`` (the
    #: producer's event time in ns of the last record handed over in order)
    order: str = "sequence"
    #: event-time mode: the stream sequence of that record (``(g, tie)`` is the position's
    #: key); both event-time modes: per partition the horizon (:mod:`..order.progress`;
    #: absent: as ``seqs``)
    tie: int = 0
    read: dict[int, int] = field(default_factory=dict)
    #: why the reader that wrote this stopped on its own (one line), or "" (running, or
    #: stopped by request); a new reader clears it when it takes the position
    error: str = ""
    #: ``event-time-exact``: the rest of the last key handed over, ``(producer, epoch, n)``
    #: (the key is ``(g, producer, epoch, n)``, :mod:`..order.producers`); None: none yet
    producer_key: tuple[str, int, int] | None = None

    def to_json(self) -> bytes:
        d: dict[str, Any] = {
            "g": self.g,
            "seqs": {str(p): s for p, s in sorted(self.seqs.items())},
            "token": self.token,
            "member": self.member,
            "ts": round(time.time(), 3),
            "stream": self.stream,
            "late": self.late,
            "order": self.order,
        }
        if self.order == "event-time":
            d["tie"] = self.tie
        if self.order in ("event-time", "event-time-exact"):
            d["read"] = {str(p): s for p, s in sorted(self.read.items())}
        if self.error:
            d["error"] = self.error
        if self.producer_key is not None:
            d["pkey"] = list(self.producer_key)
        return compact_json(d)

    @classmethod
    def from_json(cls, data: bytes) -> GlobalPosition:
        d: dict[str, Any] = json.loads(data or b"{}")
        return cls(
            int(d.get("g") or 0),
            {int(p): int(s) for p, s in (d.get("seqs") or {}).items()},
            int(d.get("token") or 0),
            str(d.get("member") or ""),
            str(d.get("stream") or ""),
            int(d.get("late") or 0),
            float(d.get("ts") or 0.0),
            str(d.get("order") or "sequence"),
            int(d.get("tie") or 0),
            {int(p): int(s) for p, s in (d.get("read") or {}).items()},
            str(d.get("error") or ""),
            _producer_key(d.get("pkey")),
        )


def _producer_key(v: Any) -> tuple[str, int, int] | None:
    if not isinstance(v, list) or len(v) != 3:
        return None
    return (str(v[0]), int(v[1]), int(v[2]))


class GlobalPositions:
    """Reads, grants and writes the position of one group (its state bucket ``state``)."""

    def __init__(
        self, nc: NATS, state: KeyValue, bucket: str, stream: str, group: str, created: str
    ) -> None:
        self.nc = nc
        self.state = state
        self.bucket = bucket
        self.stream = stream
        self.group = group
        self.created = created
        self.revision = 0
        self.current = GlobalPosition()

    async def grant(self, member: str, order: str = "sequence") -> GlobalPosition:
        """Take the position over with a new fencing token; returns it. A position that
        has handed nothing over yet takes ``order``; otherwise it keeps its own (the
        caller refuses a mismatch)."""
        while True:
            found = await latest_entry(self.nc, self.bucket, POSITION_KEY)
            if found is not None and found[0] is None:
                raise GlobalPositionMissing(
                    f"the global-order position of group {self.group} on stream {self.stream} "
                    "was deleted: starting over would hand every record to the handler again. "
                    f"To start over on purpose, delete the group (`nats-ordered group delete "
                    f"--stream {self.stream} --group {self.group}`)"
                )
            old = GlobalPosition.from_json(found[0]) if found and found[0] else GlobalPosition()
            if old.stream and self.created and old.stream != self.created:
                raise StreamRecreated(
                    f"stream {self.stream} was deleted and created again since group "
                    f"{self.group} recorded its global-order position: delete the group "
                    f"(`nats-ordered group delete --stream {self.stream} --group "
                    f"{self.group}`) and start the reader again"
                )
            new = GlobalPosition(
                old.g,
                dict(old.seqs),
                next_token(old.token, 0, int(time.time() * 1000)),
                member,
                self.created,
                old.late,
                order=old.order if (old.g or old.seqs) else order,
                tie=old.tie,
                read=dict(old.read),
                producer_key=old.producer_key,
            )
            try:
                if found is None:
                    rev = await self.state.create(POSITION_KEY, new.to_json())
                else:
                    rev = await self.state.update(POSITION_KEY, new.to_json(), last=found[1])
            except KeyWrongLastSequenceError:
                continue  # another reader took it meanwhile: take it from that one
            self.revision, self.current = rev, new
            return new

    async def commit(
        self,
        g: int,
        seqs: dict[int, int],
        late: int | None = None,
        *,
        tie: int = 0,
        read: dict[int, int] | None = None,
        error: str = "",
        producer_key: tuple[str, int, int] | None = None,
    ) -> None:
        """Write ``g`` and ``seqs`` (and the count of ``late`` records, unchanged if None;
        the event-time modes' ``tie``, ``read`` and ``producer_key``; the ``error`` that
        stopped the reader)
        under this reader's token; :class:`Fenced` if a newer reader has taken the position."""
        cur = self.current
        late = cur.late if late is None else late
        new = GlobalPosition(
            g,
            dict(seqs),
            cur.token,
            cur.member,
            cur.stream,
            late,
            order=cur.order,
            tie=tie,
            read=dict(read or {}),
            error=error,
            producer_key=producer_key,
        )
        value = new.to_json()
        try:
            self.revision = await self.state.update(POSITION_KEY, value, last=self.revision)
        except KeyWrongLastSequenceError:
            found = await latest_entry(self.nc, self.bucket, POSITION_KEY)
            if found is not None and found[0] is not None:
                now = GlobalPosition.from_json(found[0])
                if (now.token, now.g, now.seqs, now.late) == (cur.token, g, new.seqs, late):
                    self.revision, self.current = found[1], new  # our write, reply lost
                    return
            raise Fenced(
                f"group {self.group}'s global-order position on stream {self.stream} was "
                "taken over by another reader (a newer fencing token): this reader stops"
            ) from None
        self.current = new


__all__ = [
    "POSITION_KEY",
    "READER_KEY",
    "GlobalPosition",
    "GlobalPositionMissing",
    "GlobalPositions",
]
