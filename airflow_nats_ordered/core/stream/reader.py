"""A partition's reader (:class:`PartitionReader`): one partition, in order, from a sequence on.

Guarantees: the worker's only way to read a partition. What it hands out is in stream
order with nothing skipped: an ack-none pull consumer re-sends nothing, so every delivery's
consumer sequence must follow the previous one (idle heartbeats name the last one sent, so
even a lost *last* delivery is noticed); on a gap, a reconnect, an unexpected status or
silence, the consumer is re-created at the first sequence not yet handed out, after the
worker's ``verify`` hook confirmed that position is still part of the stream's history.
Memory is bounded twice: at most ``2 * batch`` messages and ``budget()`` bytes buffered or
requested per partition (a single larger message is still read, alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError
from nats.protocol import parser as _nats_parser

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.connection.api import api_subject, jetstream
from airflow_nats_ordered.core.stream import frames
from airflow_nats_ordered.core.stream.message import HDR_MSG_ID

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")


#: the pure and compiled hot loop (:mod:`.frames`): the names this module always had
_sequences = frames.sequences
parse_headers = frames.parse_headers
Delivery = frames.Delivery
_NAMES = frames._NAMES
_NAMES_MAX = frames._NAMES_MAX
_header_name = frames._header_name
_hmsg = frames.hmsg_py
_msg_size = frames.msg_size_py
_HDR_LINE = frames.HDR_LINE


class Routed(Protocol):
    """What :func:`_route` hands a message to (a reader, or the commit writes' answers)."""

    async def _on_msg(self, m: Any) -> None: ...


#: what :func:`_route` hands a subscription's messages to: the target, and the target's
#: synchronous entry for a data message with its header block's size (None: every message
#: goes to ``_on_msg``)
Route = tuple[Routed, Callable[[Any, int], None] | None]


def _route(nc: NATS) -> dict[int, Route] | None:
    """The connection's map of reader inboxes (subscription id -> reader), installing it on
    first use: the deliveries of those inboxes go to their reader in the order read from
    the socket, without nats-py's per-message work (header parsing, a ``Msg``, a queue and a
    task switch per message), from the task reading the socket; every other message takes
    nats-py's own path. None if this nats-py has no ``_process_msg`` to route through
    (readers then use their subscription's callback). :mod:`..group.cas_writes` routes the answers
    to commit writes here too. A message its target cannot read is logged and dropped,
    never raised into nats-py's read loop (which would stop reading for good)."""
    routes: dict[int, Route] | None = getattr(nc, "_nor_routes", None)
    if routes is not None:
        return routes
    original = getattr(nc, "_process_msg", None)
    if original is None or not inspect.iscoroutinefunction(original):
        return None
    table: dict[int, Route] = {}
    stats = nc.stats

    async def process_msg(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        route = table.get(sid)
        if route is None:
            await original(sid, subject, reply, data, headers)
            return
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        try:
            if headers and headers[_HDR_LINE : _HDR_LINE + 1] == b" ":
                # a status (heartbeat, request ended, consumer gone): rare, parsed by nats-py
                parsed = await nc._process_headers(headers)
                m = Delivery(subject.decode(), reply.decode(), data, None, parsed)
            else:
                m = Delivery(subject.decode(), reply.decode(), data, headers or None)
                on_data = route[1]
                if on_data is not None and headers:
                    on_data(m, len(headers))  # no coroutine per message
                    return
            await route[0]._on_msg(m)
        except Exception:
            # never into nats-py's read loop: it ends on any error, without reconnecting,
            # and the member would read nothing more (answers included). A message that is
            # not what its target reads (another client's publish to a reader's inbox, with
            # a reply that is no JetStream ACK subject) is dropped; a lost delivery is
            # noticed by the reader's consumer-sequence check and read again
            log.warning("a message on %r could not be read; dropped", subject, exc_info=True)

    nc._process_msg = process_msg  # type: ignore[method-assign]
    nc._nor_routes = table  # type: ignore[attr-defined]
    _install_parser(nc, table, process_msg, stats)
    return table


def _install_parser(
    nc: NATS,
    table: dict[int, Route],
    process_msg: Callable[[int, bytes, bytes, bytes, bytes], Awaitable[None]],
    stats: dict[str, int],
) -> None:
    """Replace the connection's protocol parser's ``parse`` with one that cuts the frames of
    a read itself: a reader's data delivery (an ``HMSG`` to a routed inbox whose target has
    a synchronous entry) goes to that entry at once, without nats-py's two regular
    expressions, its argument dict, two copies and a coroutine per message; a routed
    ``MSG``/``HMSG`` otherwise goes to the route's ``process_msg``; every other frame
    (``PING``, ``INFO``, ``-ERR``, other subscriptions' messages) is handed to nats-py's own
    ``parse``, one whole frame at a time, so what nats-py does with it is unchanged. A frame
    not complete yet stays in the buffer for the next read, as nats-py leaves it. The
    cutting is :func:`.frames.cut` (compiled where it was built: one call for all the data
    deliveries of a read, on the buffer in place; the pure twin gets a copy). Nothing
    is installed if the parser is not the one this was written against (nats-py's
    ``Parser`` with its ``buf`` and ``state``); then every frame takes nats-py's path."""
    ps = getattr(nc, "_ps", None)
    orig = getattr(ps, "parse", None)
    control = getattr(_nats_parser, "AWAITING_CONTROL_LINE", None)
    if (
        ps is None
        or orig is None
        or not inspect.iscoroutinefunction(orig)
        or control is None
        or not isinstance(getattr(ps, "buf", None), bytearray)
        or getattr(ps, "state", None) is None
    ):
        return

    cut = frames.cut
    in_place = frames.COMPILED  # the compiled cutter reads the bytearray itself

    async def parse(data: bytes = b"") -> None:
        buf = ps.buf
        if ps.state != control:
            await orig(data)  # in the middle of a frame nats-py's parser began: its own
            return
        if data:
            buf.extend(data)
        chunk = buf if in_place else bytes(buf)
        pos = 0
        try:
            while True:
                # every data delivery up to the next frame that needs more than this
                pos, frame_end, frame = cut(chunk, pos, table, stats)
                if frame_end < 0:
                    break  # what is left is a frame not complete yet
                if frame is not None:
                    pos = frame_end
                    await process_msg(*frame)
                    if ps.buf is not buf:
                        return  # the parser was reset meanwhile (a reconnect)
                    continue
                # one whole frame through nats-py's own parser (which raises its
                # ProtocolError for a line it cannot read)
                one = bytearray(chunk[pos:frame_end])
                ps.buf = one
                try:
                    await orig()
                finally:
                    if ps.buf is one:
                        ps.buf = buf
                pos = frame_end
                if ps.buf is not buf:
                    return  # the parser was reset meanwhile (a reconnect)
        finally:
            if ps.buf is buf and pos:
                del buf[:pos]

    ps.parse = parse


class PartitionReader:
    """Reads one partition from a start sequence with an ack-none pull consumer, keeping at
    most two pull requests in flight: pipelined, and bounded twice. At most ``2 * batch``
    messages, and at most ``budget()`` bytes, are buffered or requested for a partition at
    any time (each request carries ``max_bytes``), so lease renewals never queue behind
    megabytes of data on the shared connection and memory does not grow with message size.
    A single message larger than half the budget is still read: alone, once nothing else
    is buffered or in flight (the server ends a request whose next message does not fit
    with a 409 "Message Size Exceeds MaxBytes" and never sends that message).

    With ack-none nothing is re-sent, so nothing may be lost between server and handler:
    every delivery's consumer sequence must follow the previous one, and the idle
    heartbeats of pending requests name the last consumer sequence the server sent (so a
    lost *last* delivery is noticed within about ``HEARTBEAT`` seconds, not only when a
    later message arrives). On a gap, a reconnect of the client, an unexpected status, or
    silence (no heartbeat for ``SILENCE`` seconds: the consumer's server died), the
    consumer is re-created at the first sequence not yet handed out; anything delivered
    twice is dropped. Each re-creation attempt is bounded (``OPEN_TIMEOUT``, doubling), so
    a partition resumes soon after a stream's leader election, not after nats-py's 5 s
    timeout per API call."""

    EXPIRES = 5.0
    HEARTBEAT = 1.0  # the server requires EXPIRES >= 2 * HEARTBEAT
    #: seconds without a delivery or an idle heartbeat, while a request is pending and the
    #: reader waits, after which the consumer is taken for lost (its server died: nothing
    #: says so on the wire) and re-created; the server sends a heartbeat every HEARTBEAT
    SILENCE = 3 * HEARTBEAT
    #: the per-attempt bound on re-creating the consumer (verify + create): a JS API call
    #: to a stream that is electing a leader gets no answer at all, not even after the
    #: election, and nats-py's default of 5 s per call kept a partition waiting long after
    #: it. Attempts still failing after ELECTION seconds (longer than nats-server's
    #: elections take) double it, up to OPEN_TIMEOUT_MAX, so a slow but healthy server is
    #: never starved; a success resets it
    OPEN_TIMEOUT = 1.0
    OPEN_TIMEOUT_MAX = 8.0
    ELECTION = 10.0
    #: seconds without a pull request after which the server removes a consumer: how a
    #: stopped reader's consumer ends (it is never deleted by the reader)
    INACTIVE_THRESHOLD = 30.0

    def __init__(
        self,
        nc: NATS,
        stream: str,
        subject: str,
        start: int,
        batch: int,
        budget: Callable[[], int],
        verify: Callable[[int, str | None], Awaitable[Any]] | None = None,
        start_id: str | None = None,
    ) -> None:
        #: awaited with (the last sequence handed out, its Nats-Msg-Id) before the consumer
        #: is re-created (never before the first): raises if that position is no longer
        #: part of the stream (a re-created stream, or stored state that went back)
        self.verify = verify
        self._opened = False
        self.nc = nc
        self.js = jetstream(nc)
        self.stream = stream
        self.subject = subject
        self.next_seq = max(1, start)
        #: the Nats-Msg-Id of the message at next_seq - 1 (None if unknown)
        self.last_id = start_id
        self.batch = batch
        self.budget = budget
        self.sub: Any = None
        self.consumer = ""
        self.inbox = ""
        self._next = ""  # the subject pull requests go to (set with the consumer)
        self._ready = asyncio.Event()
        #: what the inbox's data deliveries do, from the task reading the socket (compiled
        #: where it was built): the buffer, the requests' accounting, the gap check
        self._in = frames.Inbox(self._ready, self._gap)
        self._buf: deque[tuple[int, Any, int]] = self._in.buf  # (stream seq, message, size)
        # pull requests in flight, oldest first (the server serves them in order):
        # [messages still due, bytes still allowed, messages received]
        self._requests: deque[list[int]] = self._in.requests
        self._oversize = False  # the next message alone exceeds a request's max_bytes
        self._reconnects = 0
        self._handed = False  # the last fetch returned messages (the handler ran since)
        self._open_timeout = self.OPEN_TIMEOUT
        self._failing_since = 0.0  # monotonic time of the first failed attempt in a row

    def _end_request(self, status: str) -> None:
        """The oldest request ended early (expired, or its next message did not fit)."""
        if not self._requests:
            return
        req = self._requests.popleft()
        if status == "409" and req[2] == 0:
            self._oversize = True  # not even the first message fitted: read it alone

    async def _on_msg(self, m: Any) -> None:
        """A message of the inbox: a :class:`Delivery` from the fast route (:func:`_route`),
        or nats-py's ``Msg`` through the subscription's callback."""
        if type(m) is Delivery and m._raw is not None:
            self._on_data(m, len(m._raw))  # a data message: its headers are parsed later
            return
        h = m.headers
        if h and h.get("Status"):
            self._on_status(h)
        else:
            self._on_data(m, sum(len(k) + len(v) + 4 for k, v in h.items()) + 12 if h else 0)

    def _on_status(self, h: dict[str, str]) -> None:
        self._last_activity = time.monotonic()
        status = h.get("Status")
        if status:
            desc = h.get("Description", "")
            if status == "100":
                last = h.get("Nats-Last-Consumer", "")
                if last.isdigit() and int(last) > self._cseq and not self._lost:
                    log.warning(
                        "reader of %s: deliveries %d..%s lost on the wire; re-reading from seq %d",
                        self.subject,
                        self._cseq + 1,
                        last,
                        self.next_seq,
                    )
                    self._lost = True
            elif status == "408" or (status == "409" and desc == "Message Size Exceeds MaxBytes"):
                self._end_request(status)
            elif status == "409" and desc == "Batch Completed":
                pass  # sent after the last message of a request that asked for heartbeats
            else:  # 409 consumer deleted / leadership change, 503, ...
                log.info(
                    "reader of %s: status %s %s; re-creating the consumer",
                    self.subject,
                    status,
                    desc,
                )
                self._lost = True
        self._ready.set()

    # the intake's state, read and set by the reader's own (slower) paths
    @property
    def _buf_bytes(self) -> int:
        return int(self._in.buf_bytes)

    @_buf_bytes.setter
    def _buf_bytes(self, value: int) -> None:
        self._in.buf_bytes = value

    @property
    def _last_activity(self) -> float:
        return float(self._in.last_activity)

    @_last_activity.setter
    def _last_activity(self, value: float) -> None:
        self._in.last_activity = value

    @property
    def _lost(self) -> bool:
        return bool(self._in.lost)

    @_lost.setter
    def _lost(self, value: bool) -> None:
        self._in.lost = value

    @property
    def _cseq(self) -> int:
        """The last consumer sequence received."""
        return int(self._in.cseq)

    @_cseq.setter
    def _cseq(self, value: int) -> None:
        self._in.cseq = value

    def _on_data(self, m: Any, hsize: int) -> None:
        """A delivery ``m`` whose header block is ``hsize`` bytes long (:class:`.frames.Inbox`:
        the consumer sequence checked, the requests' accounting, the buffer)."""
        self._in.take(m, hsize)

    def _gap(self, cseq: int) -> None:
        """The intake's delivery ``cseq`` does not follow the last one: the intake stops
        taking deliveries (``_lost``) until the consumer is re-created."""
        log.warning(
            "reader of %s: delivery %d after %d (lost on the wire); re-reading from seq %d",
            self.subject,
            cseq,
            self._cseq,
            self.next_seq,
        )

    async def _open(self) -> None:
        await self.close(wait=False)
        async with asyncio.timeout(self._open_timeout):
            await self._verify_and_create()
        self._open_timeout, self._failing_since = self.OPEN_TIMEOUT, 0.0

    async def _verify_and_create(self) -> None:
        if self._opened and self.verify is not None:
            # a consumer lost with its stream (or with the servers' stored state) must not
            # resume on a stream that hands out the sequences after next_seq again
            await self.verify(self.next_seq - 1, self.last_id)
        self._opened = True
        info = await self.js.add_consumer(
            self.stream,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self.next_seq,
                ack_policy=api.AckPolicy.NONE,
                filter_subject=self.subject,
                inactive_threshold=self.INACTIVE_THRESHOLD,
                mem_storage=True,
                num_replicas=1,
            ),
        )
        self.consumer = info.name or ""
        self.inbox = self.nc.new_inbox()
        js_api = getattr(self.js, "_prefix", "$JS.API")
        self._next = f"{js_api}.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"
        denials.expect(self.nc, self.inbox, self._next)  # a refusal names them as written
        self.sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)
        routes = _route(self.nc)
        if routes is not None:
            # data messages straight to _on_data, unless _on_msg is not this class's own
            # (a subclass, or a test counting or dropping deliveries, sees every message)
            stock = type(self)._on_msg is _STOCK_ON_MSG
            routes[self.sub._id] = (self, self._in.entry if stock else None)
        self._lost = False
        self._oversize = False
        self._cseq = 0
        self._reconnects = self.nc.stats["reconnects"]
        self._last_activity = time.monotonic()

    async def _pull(self, batch: int, max_bytes: int | None) -> None:
        req: dict[str, int] = {
            "batch": batch,
            "expires": int(self.EXPIRES * 1e9),
            "idle_heartbeat": int(self.HEARTBEAT * 1e9),
        }
        if max_bytes is not None:
            req["max_bytes"] = max_bytes
        await self.nc.publish(
            api_subject(self.nc, f"CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"),
            json.dumps(req).encode(),
            reply=self.inbox,
        )
        self._requests.append([batch, max_bytes if max_bytes is not None else 1 << 62, 0])

    async def _pull_what_fits(self) -> None:
        """Top up to two requests in flight within the count and byte bounds."""
        if self._oversize:
            if not self._requests and not self._buf:
                self._oversize = False
                await self._pull(1, None)  # one message, whatever its size
            return
        budget = self.budget()
        while len(self._requests) < 2:
            due = sum(r[0] for r in self._requests)
            allowed = sum(max(0, r[1]) for r in self._requests)
            room = min(budget // 2, budget - self._buf_bytes - allowed)
            if due + len(self._buf) > self.batch or room < budget // 4:
                return
            await self._pull(self.batch, max(1, room))

    async def fetch(self, timeout: float) -> list[tuple[int, Any]]:
        """Up to ``batch`` (stream seq, message) pairs in order; [] after ``timeout``.
        What a previous call returned counts as released (handled) from now on. Raises
        :class:`~..errors.PermissionDenied` once the server refused the reader's pull
        requests or its inbox (the NATS user lacks a permission: retrying cannot help)."""
        if self.consumer:
            refused = denials.denied(self.nc, publish=self._next, subscribe=self.inbox)
            if refused is not None:
                raise refused
        now = time.monotonic()
        if self._handed:
            # the handler ran since the last call: deliveries and heartbeats that arrived
            # meanwhile may still wait behind it, so only silence from here on counts
            self._last_activity = max(self._last_activity, now)
            self._handed = False
        try:
            silent = now - self._last_activity > self.SILENCE
            if (
                self.sub is None
                or self._lost
                or (self._requests and silent)
                or self.nc.stats["reconnects"] != self._reconnects
            ):
                await self._open()
            await self._pull_what_fits()
        except (NatsError, NotFoundError, TimeoutError) as exc:
            now = time.monotonic()
            self._failing_since = self._failing_since or now
            if isinstance(exc, TimeoutError) and now - self._failing_since > self.ELECTION:
                # failing for longer than an election lasts: a slow server, not a silent
                # one; give it more time per attempt
                self._open_timeout = min(self.OPEN_TIMEOUT_MAX, self._open_timeout * 2)
            log.info(
                "reader of %s: %s; retrying at seq %d",
                self.subject,
                str(exc) or type(exc).__name__,
                self.next_seq,
            )
            await self.close(wait=False)
            await asyncio.sleep(min(timeout, 0.5))
            return []
        if not self._buf:
            self._ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return []
        # in order, without what was re-delivered after the consumer was re-created
        out, self.next_seq = self._in.drain(self.batch, self.next_seq)
        if out:
            self.last_id = (out[-1][1].headers or {}).get(HDR_MSG_ID)
            self._handed = True
        return out

    async def close(self, wait: bool = True) -> None:
        """Stop reading: unsubscribe and forget the consumer, which the server removes
        after its inactive threshold (``wait`` is kept for callers; nothing is awaited)."""
        if self.sub is not None:
            routes = getattr(self.nc, "_nor_routes", None)
            if routes is not None:
                routes.pop(self.sub._id, None)
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
            self.sub = None
        # the consumer is not deleted: the server removes it INACTIVE_THRESHOLD seconds
        # after its last pull request ends (at most EXPIRES from now), and its few
        # deliveries meanwhile go to an inbox nobody reads. A delete would need
        # CONSUMER.DELETE.<stream>.*, which lets a worker delete any consumer of the
        # stream (other groups', the Airflow watcher's durable): workers and readers are
        # not granted it (docs/security.md)
        self.consumer = ""
        self._buf.clear()
        self._buf_bytes = 0
        self._requests.clear()


#: PartitionReader's own _on_msg (a reader whose class has another takes no short cut)
_STOCK_ON_MSG = PartitionReader._on_msg
