"""The reader's hot loop on a socket read's bytes (issue 33), pure Python: the reference.

Three pure functions and the object they make, moved out of :mod:`.reader` so that a
compiled twin (``_frames.pyx`` beside this module, built at install by setup.py) can take
them over; the twin is used when it was built, unless ``NATS_ORDERED_NO_EXTENSIONS`` is set
(:mod:`.compiled`). Both are tested against the same golden vectors
(tests/core/stream/test_frames_golden.py) and against nats-py's own parser.

* :func:`cut` - the frames of a read: each reader's data delivery straight to its route's
  synchronous entry, in order; returns at the first frame that needs an ``await``
  (a routed status or commit answer, for the route's ``process_msg``; any other frame,
  for nats-py's own parser) or that is not complete yet;
* :func:`parse_headers` - a data message's header block, exactly as nats-py parses it;
* :func:`sequences` - (stream sequence, consumer sequence) from a JetStream reply subject;
* :class:`Delivery` - what a reader's inbox delivery becomes (the attributes of nats-py's
  ``Msg`` the worker uses).

The pure functions stay importable under their own names (``cut_py``, ``parse_headers_py``,
``sequences_py``, ``Delivery_py``) so tests can run both twins.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from airflow_nats_ordered.core.stream import compiled

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

#: a routed message's arguments for the route's ``process_msg``: sid, subject, reply,
#: payload, header block
Frame = tuple[int, bytes, bytes, bytes, bytes]


def sequences_py(reply: str) -> tuple[int, int]:
    """(stream sequence, consumer sequence) from a JetStream delivery's reply subject, in
    both ACK subject formats."""
    t = reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>            (v1)
    # $JS.ACK.<domain>.<acchash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>...     (v2)
    return (int(t[5]), int(t[6])) if len(t) == 9 else (int(t[7]), int(t[8]))


_WS = re.compile(r"\s")
_TRIM = " \t\n\r\x0b\x0c"  # what bytes.strip() removes (nats-py trims the bytes)


#: a header line's text before its first colon -> the header name nats-py makes of it, or
#: None if it skips the line (names repeat from message to message: each is checked once)
_NAMES: dict[str, str | None] = {}
_NAMES_MAX = 4096


def _header_name(text: str) -> str | None:
    stripped = text.strip(_TRIM)
    name = stripped if stripped.isascii() and not _WS.search(stripped) else None
    if len(_NAMES) >= _NAMES_MAX:
        _NAMES.clear()  # bounded: a stream of ever new names costs a check each, no memory
    _NAMES[text] = name
    return name


def parse_headers_py(raw: bytes) -> dict[str, str]:
    """A data message's header block (``NATS/1.0\\r\\nName: Value\\r\\n...``) as nats-py
    parses it (``Client._parse_header_lines``): names ASCII without blanks, names and values
    trimmed of ASCII whitespace, values decoded as UTF-8 with replacement, the last of a
    repeated name wins; without nats-py's per-character scan of every name, which was a
    third of a busy worker's CPU time (and each distinct name is checked once, not per
    message). The first line (``NATS/1.0``) is skipped, and so are the trailing line breaks
    (they could only end the last value, which is trimmed of them anyway)."""
    out: dict[str, str] = {}
    names = _NAMES
    text = raw.decode("utf-8", "replace").partition("\r\n")[2].rstrip("\r\n")
    for line in text.split("\r\n"):
        before, sep, value = line.partition(":")
        if sep:
            try:
                name = names[before]
            except KeyError:
                name = _header_name(before)
            if name is not None:
                out[name] = value.strip(_TRIM)
    return out


class Delivery_py:  # noqa: N801 - the pure twin of the compiled Delivery
    """A message of a reader's inbox taken off the socket by the fast route
    (:func:`.reader._route`), with the attributes of nats-py's ``Msg`` the worker uses:
    ``subject``, ``reply``, ``data`` and ``headers`` (a dict or None), the latter parsed
    from the raw block on first use (:func:`parse_headers`), i.e. when the worker builds
    its batch. ``seqs``: the reply subject's (stream, consumer) sequences when the frame
    cutter already read them (the compiled one does), else None."""

    __slots__ = ("subject", "reply", "data", "_raw", "_headers")

    #: the pure cutter leaves the sequences to the reader (:func:`sequences`)
    seqs: tuple[int, int] | None = None

    def __init__(
        self,
        subject: str,
        reply: str,
        data: bytes,
        raw: bytes | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.subject = subject
        self.reply = reply
        self.data = data
        self._raw = raw
        self._headers = headers

    @property
    def headers(self) -> dict[str, str] | None:
        if self._raw is not None:
            self._headers, self._raw = parse_headers_py(self._raw), None
        return self._headers


class Inbox_py:  # noqa: N801 - the pure twin of the compiled Inbox
    """A reader's intake (:class:`.reader.PartitionReader`): what each data delivery of its
    inbox does to it, from the task reading the socket. ``entry(m, hsize)`` (the route's
    synchronous entry) takes a delivery ``m`` whose header block is ``hsize`` bytes long:
    its consumer sequence must follow ``cseq`` (else ``on_gap(cseq)`` is called, ``lost``
    set and nothing more taken until the reader re-creates its consumer); it is counted
    against the oldest pull request in ``requests`` ([messages due, bytes allowed,
    messages received]) and appended to ``buf`` as (stream seq, message, size), with
    ``buf_bytes``; ``ready`` is set when ``buf`` stops being empty (it stays set while
    anything is buffered: the reader clears it only when ``buf`` is empty).
    ``last_activity``: ``time.monotonic()`` of the last delivery."""

    __slots__ = (
        "buf",
        "buf_bytes",
        "requests",
        "ready",
        "on_gap",
        "cseq",
        "lost",
        "last_activity",
        "entry",
    )

    def __init__(self, ready: Any, on_gap: Callable[[int], None]) -> None:
        self.buf: deque[tuple[int, Any, int]] = deque()
        self.buf_bytes = 0
        self.requests: deque[list[int]] = deque()
        self.ready = ready
        self.on_gap = on_gap
        self.cseq = 0
        self.lost = False
        self.last_activity = 0.0
        self.entry: Callable[[Any, int], None] = self.take

    def take(self, m: Any, hsize: int) -> None:
        """A delivery ``m`` whose header block is ``hsize`` bytes long."""
        self.last_activity = time.monotonic()
        reply = m.reply
        if self.lost or not reply:
            return  # the consumer is being re-created; or not a delivery
        seq, cseq = sequences_py(reply)  # the pure cutter does not read them
        if cseq != self.cseq + 1:
            self.on_gap(cseq)
            self.lost = True
            self.ready.set()
            return
        self.cseq = cseq
        # its size as the server counts it against max_bytes (approximately)
        size = len(m.subject) + len(reply) + hsize + len(m.data)
        requests = self.requests
        if requests:
            req = requests[0]
            req[0] -= 1
            req[1] -= size
            req[2] += 1
            if req[0] <= 0:
                requests.popleft()
        buf = self.buf
        if not buf:
            self.ready.set()
        buf.append((seq, m, size))
        self.buf_bytes += size

    def drain(self, batch: int, next_seq: int) -> tuple[list[tuple[int, Any]], int]:
        """Up to ``batch`` (stream seq, message) pairs off ``buf``, in order, skipping what
        comes before ``next_seq`` (re-delivered after the consumer was re-created); and the
        sequence after the last one taken (``next_seq`` if none)."""
        out: list[tuple[int, Any]] = []
        buf = self.buf
        taken = 0
        while buf and len(out) < batch:
            seq, m, size = buf.popleft()
            taken += size
            if seq < next_seq:
                continue
            out.append((seq, m))
            next_seq = seq + 1
        self.buf_bytes -= taken
        return out, next_seq


#: the length of a header block's first line, ``NATS/1.0``; a status follows it after a blank
HDR_LINE = len(b"NATS/1.0")


def hmsg_py(chunk: bytes, start: int, end: int) -> tuple[bytes, int, bytes, int, int] | None:
    """An ``HMSG`` control line's arguments (between ``start`` and ``end``): subject, sid,
    reply (b"" if none), header size, total size; None if it is not one nats-py reads (or
    its sizes do not fit one another: nats-py's own parser then decides)."""
    args = chunk[start:end].split()
    try:
        if len(args) == 5:
            hsize, total = int(args[3]), int(args[4])
            if 0 <= hsize <= total:
                return args[0], int(args[1]), args[2], hsize, total
        elif len(args) == 4:
            hsize, total = int(args[2]), int(args[3])
            if 0 <= hsize <= total:
                return args[0], int(args[1]), b"", hsize, total
    except ValueError:
        pass
    return None


def msg_size_py(chunk: bytes, start: int, end: int) -> int | None:
    """An ``MSG`` control line's payload size; None if it is not one nats-py reads."""
    args = chunk[start:end].split()
    if len(args) in (3, 4) and args[-1].isdigit():
        return int(args[-1])
    return None


Route = tuple[Any, Callable[[Any, int], None] | None]


def cut_py(
    chunk: bytes, pos: int, table: dict[int, Route], stats: dict[str, int]
) -> tuple[int, int, Frame | None]:
    """Cut the frames of ``chunk`` (a read's bytes, not yet parsed from ``pos`` on): each
    data delivery to a routed inbox whose route has a synchronous entry (``table[sid][1]``)
    is handed to that entry at once as a :class:`Delivery` with its header block's size,
    counted in ``stats`` (``in_msgs``, ``in_bytes``) as nats-py counts it; an entry's error
    is logged and the delivery dropped (never raised into nats-py's read loop). Stops at
    the first frame this does not hand over itself and returns ``(pos, frame_end, frame)``:

    * ``frame_end < 0``: ``chunk[pos:]`` is an incomplete frame (or nothing), kept for the
      next read;
    * ``frame`` not None: a routed message for the route's ``process_msg(*frame)`` (a
      status, an empty header block, a route without a synchronous entry), which ends at
      ``frame_end``;
    * else ``chunk[pos:frame_end]`` is one whole frame for nats-py's own parser (``PING``,
      ``INFO``, ``-ERR``, ``+OK``, other subscriptions' messages, a line it reads its way).
    """
    n = len(chunk)
    while pos < n:
        end = chunk.find(b"\r\n", pos)
        if end < 0:
            break  # a control line not complete yet
        frame_end = end + 2  # a line alone, or a frame this does not read
        if chunk.startswith(b"HMSG ", pos):
            frame = hmsg_py(chunk, pos + 5, end)
            if frame is not None:
                subject, sid, reply, hsize, total = frame
                frame_end = end + 4 + total
                if frame_end > n:
                    break  # the payload not complete yet
                route = table.get(sid)
                if route is not None:
                    start = end + 2
                    hdr = chunk[start : start + hsize]
                    payload = chunk[start + hsize : start + total]
                    on_data = route[1]
                    if on_data is not None and hsize and hdr[HDR_LINE : HDR_LINE + 1] != b" ":
                        stats["in_msgs"] += 1
                        stats["in_bytes"] += len(payload)
                        try:
                            m = Delivery_py(subject.decode(), reply.decode(), payload, hdr)
                            on_data(m, hsize)  # no coroutine per message
                        except Exception:  # never into the read loop
                            log.warning(
                                "a message on %r could not be read; dropped",
                                subject,
                                exc_info=True,
                            )
                        pos = frame_end
                        continue
                    return pos, frame_end, (sid, subject, reply, payload, hdr)
        elif chunk.startswith(b"MSG ", pos):
            size = msg_size_py(chunk, pos + 4, end)
            if size is not None:
                frame_end = end + 4 + size
                if frame_end > n:
                    break
        return pos, frame_end, None
    return pos, -1, None


_twin = compiled.load("airflow_nats_ordered.core.stream._frames")
#: whether the compiled twin is in use (then :func:`cut` reads the parser's bytearray in
#: place; the pure one is handed a ``bytes`` copy of it)
COMPILED = _twin is not None

sequences: Callable[[str], tuple[int, int]] = sequences_py
parse_headers: Callable[[bytes], dict[str, str]] = parse_headers_py
Delivery: Any = Delivery_py
Inbox: Any = Inbox_py
cut: Callable[[Any, int, dict[int, Route], dict[str, int]], tuple[int, int, Frame | None]] = cut_py
if _twin is not None:
    sequences = _twin.sequences
    parse_headers = _twin.parse_headers
    Delivery = _twin.Delivery
    Inbox = _twin.Inbox
    cut = _twin.cut
