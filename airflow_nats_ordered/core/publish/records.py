"""A record's wire form on the publisher's hot path: its derived msg-id and the rest of its
``HPUB`` frame in one call (:func:`record_rest`), and a window's frames
(:func:`window_frames`).

The pure-Python reference of the compiled fast path's ``_records`` twin (issue 33, goals 2
and 4; :mod:`..stream.compiled`): at import this module takes the twin's functions when it
was built and ``NATS_ORDERED_NO_EXTENSIONS`` is not set; the pure ones stay importable as
``rest_form_py``, ``msg_id_py``, ``record_rest_py``, ``record_rest_id_py``, ``window_frames_py`` and
``take_acked_py``, and both run
the same golden vectors (``tests/core/publish/test_records_twins.py``). The bytes are the
wire protocol's: the msg-id of ``docs/protocol.md`` section 6 and the header block of
section 5.3 (keyed or keyless, no caller headers, no global sequence: the publisher
formats those rarer records itself).
"""

from __future__ import annotations

from binascii import hexlify
from collections import deque
from typing import Any

from airflow_nats_ordered.core.publish.msg_ids import (
    HDR_MSG_ID,
    HDR_PRODUCER,
    HDR_SEQ,
    msg_id_base,
)
from airflow_nats_ordered.core.stream import compiled

#: ``(rest of its HPUB frame, payload bytes, header + payload bytes)``: the lane's ``_Rec``
Rec = tuple[bytes, int, int]


class RestForm:
    """What every record of one producer shares: the msg-id digest of its producer id
    (:func:`.msg_ids.msg_id_base`) and its frame rest's template."""

    __slots__ = ("base", "fmt", "len0", "producer")

    def __init__(self, producer: bytes) -> None:
        self.producer = producer
        self.base = msg_id_base(producer)
        # a %-format template: a '%' of the producer id is escaped
        prod = b"%s: %s\r\n" % (HDR_PRODUCER.encode(), producer.replace(b"%", b"%%"))
        head = b"NATS/1.0\r\n%s: %%s\r\n" % HDR_MSG_ID.encode()
        tail = b"%s: %%s\r\n%s\r\n" % (HDR_SEQ.encode(), prod)
        self.fmt = b".1.$FI %d %d\r\n" + head + b"%s" + tail + b"%s\r\n"
        self.len0 = len((head + tail) % (b"", b""))  # without msg-id, key line, seq


def rest_form_py(producer: bytes) -> Any:
    """The form of ``producer``'s records (``producer``: the producer id's UTF-8 bytes)."""
    return RestForm(producer)


def msg_id_py(form: Any, place: int, kb: bytes, data: bytes) -> bytes:
    """The derived msg-id (hex, as bytes) of the record at ``place`` (1-based) with key
    bytes ``kb`` and payload ``data``: :func:`.msg_ids.msg_id_at`."""
    h = form.base.copy()
    h.update(b"%d\x00%s\x00" % (place, kb))
    h.update(data)
    return hexlify(h.digest())


def record_rest_py(form: Any, place: int, kb: bytes, key_line: bytes, seq: int, data: bytes) -> Rec:
    """One accepted record (the lane's ``_Rec``): ``(rest, payload bytes, header + payload
    bytes)``; the rest is ``.1.$FI <hdr len> <total len>\\r\\n<header block><payload>\\r\\n``
    with the derived msg-id of ``place``, ``kb`` and ``data``, the key's header line
    ``key_line`` (empty for a keyless record) and ``Nats-Ordered-Seq: <seq>``."""
    return _rest(form, msg_id_py(form, place, kb, data), key_line, seq, data)


def record_rest_id_py(
    form: Any, place: int, kb: bytes, key_line: bytes, seq: int, data: bytes, ids: list[bytes]
) -> Rec:
    """:func:`record_rest_py`, and the record's derived msg-id (hex, as bytes) appended to
    ``ids``."""
    mid = msg_id_py(form, place, kb, data)
    ids.append(mid)
    return _rest(form, mid, key_line, seq, data)


def _rest(form: Any, mid: bytes, key_line: bytes, seq: int, data: bytes) -> Rec:
    """The lane's ``_Rec`` of a record whose msg-id is ``mid``."""
    sb = b"%d" % seq
    size = len(data)
    hlen = form.len0 + len(mid) + len(key_line) + len(sb)
    total = hlen + size
    return form.fmt % (hlen, total, mid, key_line, sb, data), size, total


def window_frames_py(
    head: bytes, seq: int, queue: deque[Rec], inflight: deque[Rec], n: int, frames: list[bytes]
) -> tuple[int, int]:
    """Move ``n`` records from the head of ``queue`` to the end of ``inflight`` and append
    their frames, ``head + <batch seq> + rest``, batch seqs from ``seq + 1``, to ``frames``;
    their (payload bytes, largest header + payload)."""
    payload = largest = 0
    for _ in range(n):
        rec = queue.popleft()
        inflight.append(rec)
        seq += 1
        frames.append(b"%s%d%s" % (head, seq, rec[0]))
        payload += rec[1]
        if rec[2] > largest:
            largest = rec[2]
    return payload, largest


def take_acked_py(inflight: deque[Rec], n: int) -> int:
    """Drop the first ``n`` records of ``inflight`` (acknowledged); their payload bytes."""
    nbytes = 0
    for _ in range(n):
        nbytes += inflight.popleft()[1]
    return nbytes


rest_form = rest_form_py
msg_id = msg_id_py
record_rest = record_rest_py
record_rest_id = record_rest_id_py
window_frames = window_frames_py
take_acked = take_acked_py

_twin = compiled.load("airflow_nats_ordered.core.publish._records")
if _twin is not None:
    rest_form = _twin.rest_form
    msg_id = _twin.msg_id
    record_rest = _twin.record_rest
    record_rest_id = _twin.record_rest_id
    window_frames = _twin.window_frames
    take_acked = _twin.take_acked

#: whether this process uses the compiled twin
COMPILED = _twin is not None

__all__ = [
    "COMPILED",
    "msg_id",
    "msg_id_py",
    "record_rest",
    "record_rest_id",
    "record_rest_id_py",
    "record_rest_py",
    "rest_form",
    "rest_form_py",
    "take_acked",
    "take_acked_py",
    "window_frames",
    "window_frames_py",
]
