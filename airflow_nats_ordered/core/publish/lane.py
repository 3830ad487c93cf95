"""One partition's in-order lane of the ordered publisher: its batches, resends and acks.

Internal to :class:`~.publisher.OrderedPublisher`, which owns one :class:`_Lane` per
partition. What a lane (and the sender, :mod:`.sender`) uses of its publisher is
:class:`_LaneOwner`, here: the publisher sits on top of its lanes and its sender, which
never import it.

Technique (measured in ``bench/``, reasons in ``docs/benchmarks.md``)
--------------------------------------------------------------------
Each partition is sent as a *fast-ingest batch* (ADR-50, nats-server >= 2.14) in gap mode
``fail``: the messages are plain publishes whose reply subject carries the batch id, the
batch sequence and an operation; the server acknowledges every N messages (flow control)
and, because a gap ends the batch, **what the server stored of a batch is always a prefix
of what was sent**. On any failure (timeout, gap, lost connection, server restart, leader
change) the publisher starts a new batch and resends every unacknowledged record, in order,
with the same msg-ids: the already stored prefix is de-duplicated, the rest is appended.
Two batches can only ever store the same sequence of records, each in order, so a record is
always stored after its predecessor. A batch is committed (one round trip, which returns the
partition's last stream sequence) when it reaches ``batch_size`` records, when the
partition has been idle for ``linger`` seconds, and on
:meth:`~.publisher.OrderedPublisher.flush`.

In the steady state (its batch open, records queued or lingering) a lane *parks* and the
publisher's one sender task (:mod:`.sender`) applies its acknowledgements and sends
its windows, together with every other parked lane's; the lane's own task takes over for
everything else (opening, committing, errors, gaps, resends), exactly as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import re
import time
from collections import deque
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import PermissionDenied
from airflow_nats_ordered.core.publish import wire
from airflow_nats_ordered.core.publish.config import _MAX_BACKOFF, PublisherConfig
from airflow_nats_ordered.core.publish.msg_ids import HDR_MSG_ID, HDR_PRODUCER, HDR_SEQ
from airflow_nats_ordered.core.publish.records import take_acked, window_frames
from airflow_nats_ordered.core.publish.summary import PartitionSummary
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream
from airflow_nats_ordered.core.stream.repartition import layout_refusal

# the publisher's logger, as before the lane had its own module
log = logging.getLogger("airflow_nats_ordered.core.publish.publisher")

# Server error codes (nats-server errors.json).
_ERR_BATCH_UNKNOWN = 10208  # the batch is gone (abandoned, leader change): start another
_ERR_FAST_BATCH_DISABLED = 10205  # the stream's allow_batched is off
_ERR_TOO_MANY_BATCHES = 10211  # HTTP 429: the stream has 1,000 batches open; retry later
_ERR_WRONG_LAST_SEQ = 10071  # a Nats-Expected-Last-Subject-Sequence did not hold
#: the header of a lane's fenced first message (see _Lane.fence)
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# steps of a lane in a row that changed nothing before it yields to the event loop at each
# (a flush wakes an idle lane for one such step; the spin of issue 28 item 2 made millions)
_IDLE_STEPS_BEFORE_YIELD = 100
_EMPTY_HDR = b"NATS/1.0\r\n\r\n"
# a flow acknowledgement exactly as nats-server 2.14+ writes it: read without json.loads
# (0.4 against 2.6 us, thousands per 100k records on 16 partitions); any other form of
# reply goes through json.loads as before
_PLAIN_ACK = re.compile(rb'\{"type":"ack","seq":(\d+),"msgs":(\d+)\}')


class _Retry(Exception):
    """The current batch is lost; resend every unacknowledged record in a new batch."""


class _Fatal(Exception):
    """This partition cannot make progress; fail its remaining records."""


class _NoStream(Exception):
    """A reply without a body (a 503 no-responders status): no stream takes the subject."""


class _Fenced(Exception):
    """The lane's fenced first message was refused: the partition's subject holds messages
    stored after the sequence the fence expected (see :attr:`_Lane.fence`)."""


def fenced_rest(rest: bytes, last_seq: int) -> bytes:
    """A record's frame rest (:data:`_Rec`) with ``Nats-Expected-Last-Subject-Sequence:
    <last_seq>`` added to its header block: the server stores it only if the subject's last
    message is at ``last_seq`` (0: the subject has none)."""
    line = b"%s: %d\r\n" % (HDR_EXPECTED_LAST_SUBJECT_SEQ.encode(), last_seq)
    head, _, body = rest.partition(b"\r\n")  # b".1.$FI <hdr len> <total len>"
    mark, hlen, total = head.rsplit(b" ", 2)
    h = int(hlen)
    # the header block ends with an empty line: the new line goes before it
    block = body[: h - 2] + line + b"\r\n"
    return b"%s %d %d\r\n%s%s" % (mark, h + len(line), int(total) + len(line), block, body[h:])


def msg_id_of(rest: bytes) -> bytes:
    """The msg-id in a record's frame rest (:data:`_Rec`), or b\"\"."""
    at = rest.find(b"\r\n%s: " % HDR_MSG_ID.encode())
    if at < 0:
        return b""
    start = at + len(HDR_MSG_ID) + 4
    return rest[start : rest.index(b"\r\n", start)]


#: One accepted record: ``(rest of its HPUB frame, payload bytes, header + payload bytes)``.
#: The rest is everything after the batch sequence of its reply subject,
#: ``.1.$FI <hdr len> <total len>\r\n<header block><payload>\r\n``: built once when the
#: record is accepted, so a window's frames are ``HPUB <subject> <reply prefix><seq><rest>``
#: however often a record is resent. A plain tuple: the publisher builds one per record, and
#: a tuple costs a fraction of an object (issue 19 item 1).
_Rec = tuple[bytes, int, int]


class _Kicker(Protocol):
    """The publisher's sender (:class:`~.sender._Sender`), as a lane sees it."""

    def kick(self, lane: _Lane) -> None: ...


class _LaneOwner(Protocol):
    """What the lanes and the sender of one publisher share: the publisher's connection,
    stream and settings, its batch slots and pending bounds, its flush and close states.
    :class:`~.publisher.OrderedPublisher` is one; it owns the lanes and the sender."""

    nc: NATS
    stream: PartitionedStream
    #: the producer id of the publisher's records (a fenced lane reads it in the stream)
    producer_id: str
    #: partitions waiting for a batch slot (lingerers yield to them)
    _slot_waiters: int
    #: the largest message the server and the stream take (header block + payload)
    _max_size: int

    @property
    def config(self) -> PublisherConfig: ...

    @property
    def _inbox(self) -> str: ...

    @property
    def _batch_tag(self) -> str: ...

    @property
    def _fast(self) -> bool: ...

    @property
    def _batch_slots(self) -> asyncio.Semaphore: ...

    @property
    def _flushing(self) -> bool: ...

    @property
    def _closing(self) -> bool: ...

    @property
    def _sender(self) -> _Kicker: ...

    def _release(self, n: int, nbytes: int) -> None:
        """``n`` records of ``nbytes`` payload bytes are no longer held (stored or failed)."""


class _Lane:
    """One partition: its queue, its current fast batch and its acknowledgements."""

    def __init__(self, pub: _LaneOwner, partition: int) -> None:
        self.pub = pub
        self.cfg = pub.config
        self.p = partition
        self.subject = pub.stream.subject(partition)
        self.subject_b = self.subject.encode()
        self.inbox = f"{pub._inbox}.{partition}"
        self.reply_prefix = b""
        self.head = b""  # b"HPUB <subject> <reply prefix>" of the current batch
        self.queue: deque[_Rec] = deque()
        self.inflight: deque[_Rec] = deque()
        self.replies: deque[tuple[str, bytes]] = deque()
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.summary = PartitionSummary(partition)
        self.resume_left = 0  # positions still to pass over on resume (start_after)
        #: the stream sequence the partition's subject ended at when the caller read what
        #: earlier attempts of the run stored (0: no message), or None: the lane's first
        #: stored message carries it as Nats-Expected-Last-Subject-Sequence, so that if
        #: anything was stored there since (a failed attempt's late records), the server
        #: refuses it and the lane reads again what is stored (:meth:`_refence`)
        self.fence: int | None = None
        #: (position, msg-id) the record passed over last (resume_left reaching 0) must
        #: have: the partition's last message, when _refence extended the resume past the
        #: records in hand
        self.resume_check: tuple[int, bytes] | None = None
        #: records _refence passed over (in hand and to come): failed, not counted as
        #: stored, if the record at the checked position is not the stored one
        self._refenced = 0
        self.error: str | None = None
        self.batch_id: str | None = None
        self.batch_seq = 0
        self.acked_bseq = 0
        self.flow = self.cfg.flow
        self.broken = False
        self.slot = False  # holds one of the publisher's max_open_batches
        self.caller_ids = False  # a record of this partition carries the caller's msg-id
        self._resent_hi = 0  # highest producer seq ever put back to be resent
        self._batches = itertools.count(1)
        self._failing_since: float | None = None
        self._attempt = 0
        self.task: asyncio.Task[None] | None = None
        # served by the publisher's sender while parked (see _park and publish_sender)
        self.parked = False
        self.kicked = False  # in the sender's list for its next pass
        self.long_sleep = False  # parked on the ack timer, not linger: wake when drained
        self.progress_at = 0.0  # the last reply or send while parked (monotonic)
        self.sender_error: str | None = None  # the sender's write failed: resend
        # the error of a message the server refused ("type":"err"); its final ack follows
        self._batch_error: dict[str, Any] | None = None
        #: the server refused this lane's publishes or replies (the NATS user lacks the
        #: permission): its records fail at once, never resent
        self.denied: PermissionDenied | None = None

    # -- accepting -----------------------------------------------------------------------
    def accept(self, rec: _Rec) -> None:
        """Queue one record (``OrderedPublisher.publish`` inlines this on its hot path)."""
        self.summary.accepted += 1
        if self.error is not None:
            self.summary.failed += 1
            self.pub._release(1, rec[1])
            return
        if not self.queue:  # the lane waits for work only with an empty queue
            self.idle.clear()
            if self.parked:
                self.pub._sender.kick(self)
            else:
                self.wake.set()
        self.queue.append(rec)

    # -- the sender loop -------------------------------------------------------------------
    async def run(self) -> None:
        idle_steps = 0  # steps in a row that changed nothing
        while True:
            before = self._state()
            try:
                if not await self._step():
                    return
            except _Retry as exc:
                await self._recover(str(exc))
            except _Fatal as exc:
                self._fail(str(exc))
            except _Fenced as exc:
                await self._refence(str(exc))
            except _NoStream:  # repartitioned (or deleted) since the publisher started?
                why = await layout_refusal(self.pub.nc, self.pub.stream, self.subject)
                if why is None:
                    await self._recover("no stream took the batch (no responders)")
                else:
                    self._fail(why)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never leave records unaccounted for
                log.exception("partition %d: unexpected publisher error", self.p)
                self._fail(f"unexpected error: {exc!r}")
            if self._state() != before:
                idle_steps = 0
                continue
            # a step that changed nothing (a wake-up without work: a flush wakes every
            # idle lane) may not have suspended either. Many in a row may be a state this
            # loop did not foresee: from then on each gives the event loop a turn, so that
            # no such state can keep every other task (and close()) from running. (Only
            # from then on: yielding at every such step changed the timing of publishers
            # cancelled mid-run, see test_spark_resume's aborted job.)
            idle_steps += 1
            if idle_steps >= _IDLE_STEPS_BEFORE_YIELD:
                await asyncio.sleep(0)

    def _state(self) -> tuple[object, ...]:
        """What a step of :meth:`run` can change: a step that changes none of it waited."""
        return (
            len(self.queue),
            len(self.inflight),
            len(self.replies),
            self.batch_id,
            self.batch_seq,
            self.acked_bseq,
            self.broken,
            self.error,
        )

    def deny(self, error: PermissionDenied) -> None:
        """The server refused a publish of this partition or the replies' inbox: fail
        what is queued and in flight now (a resend would be refused too)."""
        if self.denied is None:
            self.denied = error
        self.wake.set()

    async def _step(self) -> bool:
        if self.denied is not None and (self.queue or self.inflight or self.batch_id):
            raise _Fatal(str(self.denied))
        self._drain_replies()
        if self.sender_error is not None:
            reason, self.sender_error = self.sender_error, None
            raise _Retry(reason)
        if self.broken:  # only ever of an open batch (_end_batch clears it)
            await self._await_reply(final=True)
            return True
        if self.batch_id is not None and self.batch_seq >= self.cfg.batch_size:
            await self._commit()  # the sender filled the batch
            return True
        if self.queue:
            if self.batch_id is None:
                await self._open()
            elif self._window_open():
                await self._send_window()
                if self.batch_seq >= self.cfg.batch_size:
                    await self._commit()
            else:
                await self._park()  # the sender sends the rest as acknowledgements come
            return True
        if self.batch_id is not None:
            # more records may come: wait a linger for them before committing, unless
            # other partitions wait for a batch slot
            if self.pub._flushing or self.pub._slot_waiters or await self._park():
                await self._commit()
            return True
        self.idle.set()
        if self.pub._closing:
            return False
        await self._wait_work(None)
        return True

    async def _wait_work(self, timeout: float | None, replies_only: bool = False) -> bool:
        """Wait for a reply (or, unless ``replies_only``, a new record); False on timeout."""
        self.wake.clear()
        if self.replies or (self.queue and not replies_only):
            return True
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that races with the event, and close() would then wait forever
            async with asyncio.timeout(timeout):
                await self.wake.wait()
        except TimeoutError:
            return False
        return True

    def _window_open(self) -> bool:
        out = self.batch_seq - self.acked_bseq
        return out < self.cfg.max_in_flight and out < self.flow * 2

    async def _park(self) -> bool:
        """Let the publisher's sender serve this open batch (acknowledgements, windows)
        until the lane's task has to act; True when nothing is queued and the batch is to be
        committed (idle for ``linger``, a flush, a batch slot wanted elsewhere). Raises
        _Retry when records wait and no acknowledgement came for ``ack_timeout``."""
        cfg, pub = self.cfg, self.pub
        self.progress_at = time.monotonic()
        self.parked = True
        try:
            while True:
                self.wake.clear()
                if (
                    self.replies
                    or self.denied is not None
                    or self.sender_error is not None
                    or self.broken
                    or self.batch_id is None
                    or self.batch_seq >= cfg.batch_size
                ):
                    return False
                now = time.monotonic()
                if self.queue:
                    if self._window_open():
                        pub._sender.kick(self)
                    left = self.progress_at + cfg.ack_timeout - now
                    if left <= 0:
                        raise _Retry(f"no acknowledgement within {cfg.ack_timeout:g}s")
                    self.long_sleep = True
                else:
                    if pub._flushing or pub._slot_waiters:
                        return True
                    left = self.progress_at + cfg.linger - now
                    if left <= 0:
                        return True
                    self.long_sleep = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self.wake.wait()
        finally:
            self.parked = False

    # -- served by the publisher's sender while parked -----------------------------------------
    def take_acks(self) -> bool:
        """Apply the queued plain acknowledgements of the current batch (and drop replies
        of earlier batches, as :meth:`_handle` does); False at the first other reply, which
        stays queued for the lane's task."""
        replies = self.replies
        while replies:
            bid, data = replies[0]
            if bid == self.batch_id:
                plain = _PLAIN_ACK.fullmatch(data)
                if plain is not None:
                    self._ack_to(int(plain[1]))
                    self.flow = max(1, int(plain[2]) or self.flow)
                else:
                    if not data:
                        return False
                    try:
                        msg = json.loads(data)
                    except ValueError:
                        msg = None
                    if msg is not None:
                        if msg.get("error") or msg.get("type") != "ack":
                            return False
                        self._ack_to(int(msg.get("seq") or 0))
                        self.flow = max(1, int(msg.get("msgs") or self.flow))
            replies.popleft()
        return True

    def window(self, frames: list[bytes]) -> tuple[int, int] | None:
        """Append the frames of everything the window and the batch allow to ``frames``;
        their (payload bytes, largest message), or None when there is nothing to send."""
        q, inflight = self.queue, self.inflight
        cfg = self.cfg
        out = self.batch_seq - self.acked_bseq
        n = min(
            len(q), min(cfg.max_in_flight, self.flow * 2) - out, cfg.batch_size - self.batch_seq
        )
        if n <= 0:
            return None
        # the frames, head + batch seq + rest, in one call (records.window_frames: compiled
        # where it was built)
        got = window_frames(self.head, self.batch_seq, q, inflight, n, frames)
        self.batch_seq += n
        return got

    def needs_task(self) -> bool:
        """After the sender served it: must the lane's task act now (commit a full batch;
        with the queue emptied, rearm its linger or commit for a flush or a slot)?"""
        if self.batch_seq >= self.cfg.batch_size:
            return True
        if self.queue:
            return False
        return self.long_sleep or self.pub._flushing or self.pub._slot_waiters > 0

    async def _write(self, frames: list[bytes], payload: int, largest: int, what: str) -> None:
        """Hand ready frames to the connection: every message of the lane goes through here
        (and :func:`.wire.send_frames`, the seam the fault tests break)."""
        try:
            await wire.send_frames(self.pub.nc, self.pub._fast, frames, payload, largest)
        except NatsError as exc:
            raise _Retry(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    async def _open(self) -> None:
        if not self.slot:
            self.pub._slot_waiters += 1
            try:
                await self.pub._batch_slots.acquire()
            finally:
                self.pub._slot_waiters -= 1
            self.slot = True
        # batch ids are per stream on the server: unique per publisher, partition and batch
        self.batch_id = f"{self.pub._batch_tag}p{self.p}b{next(self._batches)}"
        # <inbox>.<partition>.<batch id>.<flow>.<gap mode>.<batch seq>.<op>.$FI (ADR-50)
        self.reply_prefix = f"{self.inbox}.{self.batch_id}.{self.cfg.flow}.fail.".encode()
        self.batch_seq = 1  # the record sent below
        self.acked_bseq = 0
        self.flow = self.cfg.flow
        self.broken = False
        self.head = b"HPUB %s %s" % (self.subject_b, self.reply_prefix)
        rec = self.queue.popleft()
        self.inflight.append(rec)
        rest = rec[0]
        if self.fence is not None:
            rest = fenced_rest(rec[0], self.fence)
            if rec[2] + len(rest) - len(rec[0]) > self.pub._max_size:
                # the record fits, but not with the fence's header line: send it unfenced
                # (what a resume did before the fence) rather than refuse a valid record
                log.warning(
                    "partition %d: the first record is too large to carry the fence's "
                    "header; sent without it",
                    self.p,
                )
                self.fence, rest = None, rec[0]
        first = b"%s1.0%s" % (self.head, rest[2:])  # op 0: the batch's first message
        await self._write([first], rec[1], rec[2] + len(rest) - len(rec[0]), "send")
        # the first reply says whether the server takes the batch and at what flow
        await self._await_reply()

    async def _send_window(self) -> None:
        # everything the window and the batch allow, written as one command (issue 19 item 1)
        frames: list[bytes] = []
        got = self.window(frames)
        if got is not None:
            await self._write(frames, got[0], got[1], "send")

    async def _commit(self) -> None:
        """End the batch without storing another message; the reply acknowledges it all."""
        self.batch_seq += 1
        reply = b"%s%d.3.$FI" % (self.reply_prefix, self.batch_seq)
        end = wire.frame(self.subject_b, reply, _EMPTY_HDR, b"")
        await self._write([end], 0, len(_EMPTY_HDR), "commit")
        self.broken = True  # nothing more goes into this batch; wait for its final ack
        await self._await_reply(final=True)

    async def _await_reply(self, final: bool = False) -> None:
        """Wait for one reply of the current batch (or, with ``final``, for its end)."""
        deadline = time.monotonic() + self.cfg.ack_timeout
        current = self.batch_id
        while self.batch_id == current and current is not None:
            if self.denied is not None:
                raise _Fatal(str(self.denied))
            if self.replies:
                bid, data = self.replies.popleft()
                if self._handle(bid, data) and not final:
                    return
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Retry(f"no acknowledgement within {self.cfg.ack_timeout:g}s")
            await self._wait_work(left, replies_only=True)

    def _drain_replies(self) -> None:
        while self.replies:
            bid, data = self.replies.popleft()
            self._handle(bid, data)

    def _handle(self, bid: str, data: bytes) -> bool:
        """Apply one reply; True if it belonged to the current batch."""
        if bid != self.batch_id:
            return False  # a late reply of an abandoned batch: its records get resent anyway
        if not data:  # a status without a body: 503 no responders, no stream took it
            self._end_batch()
            raise _NoStream()
        try:
            msg = json.loads(data)
        except ValueError:
            return False
        err = msg.get("error")
        kind = msg.get("type")
        if err and kind == "err":
            # one message was not stored (a stream limit, a store failure): the server ends
            # the batch and its final ack follows with the count it stored. Wait for it, so
            # the stored prefix is acknowledged, not resent and reported failed with the rest
            self.broken = True
            if self._batch_error is None:
                self._batch_error = err
            return True
        if err:
            if "count" in msg:  # the final ack of a batch stopped by this error
                self._ack_to(int(msg.get("count") or 0))
            self._end_batch()
            self._raise_for(err)
        if kind == "ack":
            self._ack_to(int(msg.get("seq") or 0))
            self.flow = max(1, int(msg.get("msgs") or self.flow))
            return True
        if kind == "gap":
            self.broken = True  # the server abandons the batch; its final ack follows
            return True
        if "batch" in msg:  # final PubAck of the batch
            self._ack_to(int(msg.get("count") or 0))
            seq = int(msg.get("seq") or 0)
            if seq:
                self.summary.last_seq = max(self.summary.last_seq, seq)
            refused = self._batch_error
            self._end_batch()
            self.broken = False
            if refused is not None:  # it ended at a message the server refused
                self._raise_for(refused)
            if self.inflight:  # a gap: the server stored a prefix; resend the rest
                self.summary.retries += 1
                self._requeue()
            return True
        return False

    def _raise_for(self, err: dict[str, Any]) -> None:
        """Raise _Retry or _Fatal for a batch the server ended with ``err``."""
        code = err.get("err_code")
        desc = f"{err.get('description', 'error')} (err_code {code})"
        if code == _ERR_BATCH_UNKNOWN or err.get("code") == 503:
            raise _Retry(f"server dropped the batch: {desc}")
        if code == _ERR_TOO_MANY_BATCHES or err.get("code") == 429:
            raise _Retry(f"server limit reached: {desc}")
        if code == _ERR_WRONG_LAST_SEQ and self.fence is not None:
            raise _Fenced(desc)
        if code == _ERR_FAST_BATCH_DISABLED:
            raise _Fatal(
                f"stream {self.pub.stream.name} does not allow fast batch publishing: "
                f"{desc}; run `nats-ordered provision` for it (sets allow_batched)"
            )
        raise _Fatal(f"server refused a record of partition {self.p}: {desc}")

    def _ack_to(self, bseq: int) -> None:
        n = min(bseq, self.batch_seq) - self.acked_bseq
        if n <= 0:
            return
        n = min(n, len(self.inflight))
        nbytes = take_acked(self.inflight, n)
        self.acked_bseq += n
        self.summary.acked += n
        self.pub._release(n, nbytes)
        self._failing_since = None
        self._attempt = 0
        self.fence = None  # the fenced first message is stored: the fence held

    async def _recover(self, reason: str) -> None:
        refused = denials.denied(
            self.pub.nc, publish=self.subject, subscribe=f"{self.pub._inbox}.>"
        )
        if refused is not None or self.denied is not None:
            self.denied = self.denied or refused
            self._fail(str(self.denied))
            return
        if self.pub.nc.is_closed:
            self._fail(f"{reason}; the NATS connection is closed")
            return
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        self.summary.retries += 1
        self._end_batch()
        self.broken = False
        self._requeue()
        if now - self._failing_since > self.cfg.delivery_timeout:
            self._fail(f"{reason}; gave up after {self.cfg.delivery_timeout:g}s of retries")
            return
        self._attempt += 1
        # jittered, so partitions refused together (err 10211) do not retry together
        delay = min(_MAX_BACKOFF, 0.05 * 2 ** min(self._attempt, 5) * (0.5 + random.random()))
        log.warning(
            "partition %d: %s; resending %d records in %.2fs",
            self.p,
            reason,
            len(self.queue),
            delay,
        )
        await asyncio.sleep(delay)

    async def _refence(self, reason: str) -> None:
        """The fenced first message was refused (``reason``): messages were stored on the
        partition's subject after the sequence the fence expected. Nothing of the batch
        was stored (the server ends a batch at a refused message). Read the subject's last
        message: when it is this run's (its producer id), at position ``m``, the positions
        up to ``m`` are stored (a partition's records are stored in position order, and an
        earlier attempt stored them while this one started): the records for them are
        passed over, in hand and to come (``resume_left``), the one at ``m`` checked
        against the stored msg-id, and the next send is fenced at that message. When it is
        another producer's, this lane cannot tell what of the run is stored before it: it
        goes on unfenced, as a resume does without a fence."""
        self.queue.extendleft(reversed(self.inflight))
        self.inflight.clear()
        self._end_batch()
        self.broken = False
        stream = self.pub.stream
        try:
            msg = await jetstream(self.pub.nc).get_last_msg(stream.name, self.subject, direct=True)
        except NotFoundError:  # no message on the subject (purged meanwhile?)
            if self.fence == 0:  # as the fence expected: not refused for records stored
                await self._recover(f"{reason} with no message on the partition")
            self.fence = 0
            return
        except (NatsError, TimeoutError) as exc:
            await self._recover(f"{reason}; reading the partition's last message: {exc!r}")
            return
        h = msg.headers or {}
        at = h.get(HDR_SEQ, "")
        refused, self.fence = self.fence, int(msg.seq or 0)
        if refused is not None and self.fence <= refused:
            # the tail read is not past where the fence expected it: the refusal was not of
            # records stored since (a caller's own Nats-Expected-* header), the read came
            # from a replica behind its leader, or messages were removed: fenced at what
            # was read, resend after a backoff, within delivery_timeout, as for any other
            # failure
            await self._recover(f"{reason}; the partition's last message read is at {self.fence}")
            return
        if h.get(HDR_PRODUCER) != self.pub.producer_id or not at.isdigit():
            log.warning(
                "partition %d: %s: the partition's last message (stream sequence %d) is "
                "another producer's; going on without a fence",
                self.p,
                reason,
                self.fence,
            )
            self.fence = None
            return
        m = int(at)
        ls = self.summary
        first = ls.offset + ls.acked + 1  # the position of the first record in hand
        stored_id = h.get(HDR_MSG_ID, "").encode()
        log.warning(
            "partition %d: %s: positions up to %d of this run are stored (an earlier "
            "attempt's); passing over %d more",
            self.p,
            reason,
            m,
            max(0, m - first + 1),
        )
        self._failing_since = None  # nothing of the refused batch was stored: no failure
        self._attempt = 0
        if m < first:  # stored meanwhile before what this attempt sends: fence it again
            return
        n = min(m - first + 1, len(self.queue))
        if n:
            if first + n - 1 == m and msg_id_of(self.queue[n - 1][0]) != stored_id:
                self.resume_left = 0  # what comes is failed, not passed over as stored
                self._fail(self._not_stored_here(m))
                return
            nbytes = 0
            for _ in range(n):
                nbytes += self.queue.popleft()[1]
            ls.accepted -= n
            ls.offset += n
            self.pub._release(n, nbytes)
        left = m - first + 1 - n
        if left:
            self.resume_left += left
            self.resume_check = (m, stored_id)
            self._refenced = n + left

    def check_passed_over(self, msg_id: bytes) -> None:
        """The record passed over last (``resume_left`` reached 0) after :meth:`_refence`
        extended the resume: fail the partition if the stream holds another one there."""
        m, stored_id = self.resume_check or (0, b"")
        self.resume_check = None
        if msg_id != stored_id:
            self._unpass(self._not_stored_here(m))
        self._refenced = 0

    def check_resume_done(self) -> None:
        """At close: the input ended before the positions :meth:`_refence` found stored
        (an earlier attempt read a longer input, or this one's input broke off): fail the
        partition, and what was passed over is not counted as stored."""
        if self.resume_check is not None:
            m = self.resume_check[0]
            self.resume_check = None
            self._unpass(
                f"an earlier attempt stored {m} positions of partition {self.p} of run "
                f"{self.pub.producer_id!r} while this one started, but this attempt's input "
                "ended before that position: if that is the whole input, it is not the one "
                "that attempt read. Publish it again with that input, or under a new "
                "producer id"
            )

    def _unpass(self, reason: str) -> None:
        """Fail the partition; the records :meth:`_refence` passed over count as failed
        (handed over and not stored by this input), not as stored by an earlier attempt."""
        k = self._refenced - self.resume_left  # those handed over so far
        self._refenced = 0
        ls = self.summary
        ls.offset -= k
        ls.accepted += k
        ls.failed += k
        self.resume_left = 0
        self._fail(reason)

    def _not_stored_here(self, m: int) -> str:
        return (
            f"the stream holds another record at position {m} of partition {self.p} of run "
            f"{self.pub.producer_id!r} (stored by an earlier attempt while this one started): "
            "this attempt's input is not the one that attempt read, so nothing more of the "
            "partition is sent. Publish it again with that input, or under a new producer id"
        )

    def _requeue(self) -> None:
        """Put the unacknowledged records back at the head of the queue, to be resent.

        Acknowledgements are in order, so they are producer seqs ``acked+1 ..``; ``resent``
        counts each of them once, however often it is resent."""
        n = len(self.inflight)
        last = self.summary.acked + n
        if last > self._resent_hi:
            self.summary.resent += last - max(self.summary.acked, self._resent_hi)
            self._resent_hi = last
        self.queue.extendleft(reversed(self.inflight))
        self.inflight.clear()

    def _end_batch(self) -> None:
        """Forget the current batch and give its slot back. ``broken`` is a state of the
        open batch: a lane that kept it without a batch would wait for the end of none, and
        return at once, for ever (issue 28 item 2: a refused commit spun at 100% CPU)."""
        self.batch_id = None
        self.broken = False
        self._batch_error = None
        if self.slot:
            self.slot = False
            self.pub._batch_slots.release()

    async def until_idle(self) -> None:
        """Wait until every record of the lane is stored or failed. If its task ends first
        (cancelled: ``asyncio.run`` cancels every task of a loop whose main coroutine
        ended), nothing would ever send the rest: they are reported failed, not waited for."""
        if self.idle.is_set() or self.task is None:
            return
        idle = asyncio.ensure_future(self.idle.wait())
        try:
            await asyncio.wait([idle, self.task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
        if not self.idle.is_set():
            self._fail("the publisher's task for this partition was cancelled")

    def _fail(self, reason: str) -> None:
        self._end_batch()
        n = len(self.queue) + len(self.inflight)
        nbytes = sum(r[1] for r in self.queue) + sum(r[1] for r in self.inflight)
        self.queue.clear()
        self.inflight.clear()
        self.summary.failed += n
        self.error = self.summary.error = reason
        self.pub._release(n, nbytes)
        self.idle.set()
        log.error("partition %d: %s; %d records not stored", self.p, reason, n)
