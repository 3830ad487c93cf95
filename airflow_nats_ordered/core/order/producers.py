"""Several producers in one exact event-time order: the wire parts shared by the producer
(:mod:`.producer`) and the reader (:mod:`.producer_reader`), and the
operator's functions (:func:`list_producers`, :func:`close_producer`).

Every record of a global producer carries three headers (``docs/protocol.md`` 12.2):

* ``Nats-Ordered-Event-Time``: its event time (:mod:`.event_time`'s forms);
* ``Nats-Ordered-Global-Producer``: the producer's id (``[A-Za-z0-9_-]``, 1-64);
* ``Nats-Ordered-Global-Producer-Seq``: ``<epoch>.<n>``: the producer's registration epoch
  (one more at every start of that id) and a counter that increases in its publish order.

A record's **key** is ``(event time ns, producer, epoch, n)``; the merge hands records over
in increasing key order, so ties of equal event times go by producer id, then by the
producer's own publish order. Keys are unique: one running instance per producer id.

The producer's **mark**, key ``p.<producer>`` of the stream's bucket ``nor_<stream>_global``
(compact JSON ``{"producer","epoch","state","e","n","instance","ts"}``): registered
(``state`` ``"open"``, no ``e`` yet), then its **watermark** ``(e, epoch, n)``: every
record of this producer not yet stored has a key above ``(e, producer, epoch, n)``; or
``"closed"``: no record of it is stored after this mark. Marks are written by
compare-and-set on their revision, so an instance whose mark was taken over (a restart with
the same id, or :func:`close_producer`) cannot write another one.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER, parse_event_time
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.kv import bucket_keys, compact_json, latest_entry

HDR_PRODUCER_ID = "Nats-Ordered-Global-Producer"
HDR_PRODUCER_SEQ = "Nats-Ordered-Global-Producer-Seq"
#: the prefix of producer marks in the bucket ``nor_<stream>_global``
MARK_PREFIX = "p."

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SEQ = re.compile(r"([1-9][0-9]{0,17})\.([1-9][0-9]{0,17})")

#: a record's place in the order: (event time ns, producer, epoch, n)
Key = tuple[int, str, int, int]


class ProducerFenced(NatsOrderedError):
    """This producer's mark was taken over (a newer instance with the same id started, or
    an operator closed it): it writes no more marks and publishes nothing more."""


def check_producer(producer: str, name: str = "producer") -> str:
    """``producer`` if it can name a global producer, else ConfigError naming ``name``."""
    if not isinstance(producer, str) or not _ID.fullmatch(producer):
        raise ConfigError(
            f"{name} must be 1-64 letters, digits, '_' or '-' (it names the producer in the "
            f"stream's order and in a KV key), got {producer!r}"
        )
    return producer


def format_event_time(ns: int) -> str:
    """``ns`` (since the epoch) in the header's form: integer milliseconds when whole
    milliseconds, else RFC 3339 UTC with nine fraction digits."""
    return str(ns // 1_000_000) if ns % 1_000_000 == 0 else show_time(ns)


def show_time(ns: int) -> str:
    """``ns`` for a message: RFC 3339 UTC, to the nanosecond."""
    s, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def parse_producer_seq(value: str | None) -> tuple[int, int] | None:
    """``<epoch>.<n>`` as ``(epoch, n)``, or None if missing or malformed."""
    m = _SEQ.fullmatch((value or "").strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def record_key(headers: dict[str, str]) -> Key:
    """A record's key from its headers; ValueError naming the header that is missing or
    malformed (a record not published through a global producer)."""
    try:
        e = parse_event_time(headers.get(DEFAULT_TIME_HEADER))
    except ValueError as exc:
        raise ValueError(f"header {DEFAULT_TIME_HEADER}: {exc}") from None
    producer = (headers.get(HDR_PRODUCER_ID) or "").strip()
    if not _ID.fullmatch(producer):
        raise ValueError(f"header {HDR_PRODUCER_ID} is missing or not a producer id")
    seq = parse_producer_seq(headers.get(HDR_PRODUCER_SEQ))
    if seq is None:
        raise ValueError(f"header {HDR_PRODUCER_SEQ} is missing or not <epoch>.<n>")
    return (e, producer, seq[0], seq[1])


@dataclass(frozen=True)
class ProducerMark:
    """A producer's mark (see the module): ``e`` None while it promised nothing yet."""

    producer: str
    epoch: int
    state: str = "open"
    e: int | None = None
    n: int = 0
    instance: str = ""
    ts: float = 0.0
    closed_by: str = ""

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def bound(self) -> Key | None:
        """The key no unstored record of this producer is at or below (None: none yet)."""
        return None if self.e is None else (self.e, self.producer, self.epoch, self.n)

    def to_json(self) -> bytes:
        d: dict[str, Any] = {
            "producer": self.producer,
            "epoch": self.epoch,
            "state": self.state,
            "e": self.e,
            "n": self.n,
            "instance": self.instance,
            "ts": round(time.time(), 3),
        }
        if self.closed_by:
            d["closed_by"] = self.closed_by
        return compact_json(d)

    @classmethod
    def from_json(cls, data: bytes) -> ProducerMark:
        d: dict[str, Any] = json.loads(data or b"{}")
        e = d.get("e")
        return cls(
            str(d.get("producer") or ""),
            int(d.get("epoch") or 0),
            str(d.get("state") or "open"),
            None if e is None else int(e),
            int(d.get("n") or 0),
            str(d.get("instance") or ""),
            float(d.get("ts") or 0.0),
            str(d.get("closed_by") or ""),
        )


async def read_marks(nc: NATS, stream: str) -> dict[str, tuple[ProducerMark, int]]:
    """Every registered producer of ``stream``: its mark and the mark's revision."""
    bucket = watermark_bucket(stream)
    found: dict[str, tuple[ProducerMark, int]] = {}
    for key in await bucket_keys(nc, bucket, MARK_PREFIX):
        entry = await latest_entry(nc, bucket, key)
        if entry is not None and entry[0] is not None:
            mark = ProducerMark.from_json(entry[0])
            found[key[len(MARK_PREFIX) :]] = (mark, entry[1])
    return found


async def list_producers(nc: NATS, stream: str) -> dict[str, ProducerMark]:
    """The registered producers of ``stream`` (open and closed) by id."""
    return {p: m for p, (m, _) in (await read_marks(nc, stream)).items()}


async def close_producer(nc: NATS, stream: str, producer: str) -> bool:
    """Mark ``producer`` of ``stream`` closed, for one that died (readers in the exact
    event-time mode stop waiting for it). False if it was closed already. Its last
    watermark stays; a record of it stored after this is a violation the readers stop at,
    and a live instance of it can write no more marks (:class:`ProducerFenced`)."""
    check_producer(producer)
    try:
        kv = await jetstream(nc).key_value(watermark_bucket(stream))
    except (BucketNotFoundError, NotFoundError):
        raise ConfigError(
            f"stream {stream} has no global producers (no bucket {watermark_bucket(stream)}): "
            "check the stream name"
        ) from None
    while True:
        entry = await latest_entry(nc, watermark_bucket(stream), MARK_PREFIX + producer)
        if entry is None or entry[0] is None:
            known = sorted(await list_producers(nc, stream))
            raise ConfigError(
                f"stream {stream} has no global producer {producer!r}; registered: "
                f"{', '.join(known) or 'none'}"
            )
        mark = ProducerMark.from_json(entry[0])
        if mark.closed:
            return False
        closed = ProducerMark(
            mark.producer, mark.epoch, "closed", mark.e, mark.n, mark.instance, 0, "operator"
        )
        try:
            await kv.update(MARK_PREFIX + producer, closed.to_json(), last=entry[1])
        except KeyWrongLastSequenceError:
            continue  # it wrote a watermark meanwhile: close that one
        return True


__all__ = [
    "HDR_PRODUCER_ID",
    "HDR_PRODUCER_SEQ",
    "MARK_PREFIX",
    "Key",
    "ProducerFenced",
    "ProducerMark",
    "check_producer",
    "close_producer",
    "format_event_time",
    "list_producers",
    "parse_producer_seq",
    "read_marks",
    "record_key",
    "show_time",
]
