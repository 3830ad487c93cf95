"""The ordered, idempotent publisher.

Guarantees
----------
* **Per-partition order under failure.** If a send fails or times out, no later record of
  that partition is ever stored before it.
* **Exactly once for acknowledged records.** A record the server acknowledged is stored once;
  a retry or a rerun of the same input (inside the stream's ``duplicate_window``) stores
  nothing twice, because every record carries a deterministic ``Nats-Msg-Id``: a digest of
  the producer id, the record's place in the input (the count of ``publish()`` calls, or
  the caller's ``index=``), its key and its payload, nothing of the stream's layout, so a
  rerun after ``repartition`` stores nothing twice either. The place is taken when
  :meth:`OrderedPublisher.publish` is called, so concurrent ``publish()`` calls never share
  a msg-id; a publisher without a ``producer_id`` gets a unique one, so unrelated publishers
  never share one either.
* **No acknowledged record is silently de-duplicated away.** When the server calls records
  duplicates that this publisher did not expect (beyond its own resends, with no explicit
  ``producer_id`` and no caller msg-ids), they are counted as
  ``unexpected_duplicates``, not as stored, and :meth:`OrderedPublisher.flush` raises. A
  rerun with the same explicit ``producer_id`` expects duplicates: counted, not raised.
* **Resends stay inside the duplicate window.** :meth:`OrderedPublisher.start` refuses a
  stream whose ``duplicate_window`` is shorter than the longest time a record may be resent
  (:attr:`PublisherConfig.longest_resend`): a later resend would be stored again, after
  records stored since.
* **Nothing is dropped silently.** Records not confirmed as stored are counted per
  partition and reported by :meth:`OrderedPublisher.flush` (``PublishError``); records are
  acknowledged per partition in order, so the unconfirmed ones of partition p are exactly
  its records after the first ``acked``. (An unconfirmed record may still have been stored
  when its acknowledgement was lost; republishing completes the partition exactly once.)
  A temporary server limit (too many batches in flight, err 10211) is retried, not fatal.
* **Global order (opt-in).** With ``global_order=GlobalOrder()`` (:mod:`..order.watermarks`,
  a :class:`~.sequence.StreamSequence`) every record also carries ``Nats-Global-Seq``,
  taken with its position when :meth:`OrderedPublisher.publish` accepts it (publish order
  over the whole stream, starting above everything stored), and idle partitions get
  watermarks. The publisher only stamps the sequence and reports its idle points
  (:mod:`.sequence`); global order builds on it. Without it, msg-ids and header blocks
  are exactly as before.
* **Bounded memory.** At most ``max_pending`` records and ``max_pending_bytes`` payload
  bytes are held (queued or awaiting their acknowledgement); :meth:`publish` waits when
  either is reached (a single larger record goes alone). At most ``max_open_batches``
  server batches are open at once.

Where the parts live
--------------------
This module holds :class:`OrderedPublisher`; :mod:`.config` its settings
(:class:`PublisherConfig`). Each partition is sent by its lane, :mod:`.lane` (fast-ingest
batches, resends, acknowledgements: the technique and its reasons are described there), in
the steady state through the one sender task of :mod:`.sender`; both use of the publisher
only what :class:`~.lane._LaneOwner` names, and neither imports this module.
:mod:`.msg_ids` derives the ``Nats-Msg-Id`` and names the headers every record carries;
:mod:`.records` builds a record's wire form (its derived msg-id and frame rest in one call)
and a window's frames, compiled where its Cython twin was built (issue 33);
:mod:`.summary` holds :class:`PublishSummary` and :class:`PublishError`; :mod:`.sequence`
is what the publisher calls to stamp a sequence over the whole stream (global order's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import string
import time
from binascii import hexlify
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import mmh3
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.nuid import NUID

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.connection.api import inbox_prefix, jetstream
from airflow_nats_ordered.core.errors import (
    ConfigError,
    InvalidKeyError,
    InvalidMsgIdError,
    KeylessRecordError,
    PartitionMismatchError,
    PermissionDenied,
    RecordError,
    RecordTooLargeError,
)
from airflow_nats_ordered.core.publish import wire
from airflow_nats_ordered.core.publish.config import (
    _MAX_BACKOFF,
    PublisherConfig,
)
from airflow_nats_ordered.core.publish.lane import _Lane, _Rec, msg_id_of
from airflow_nats_ordered.core.publish.msg_ids import (
    HDR_MSG_ID,
    HDR_PRODUCER,
    HDR_SEQ,
    RESERVED_HEADERS,
    msg_id_base,
)
from airflow_nats_ordered.core.publish.records import (
    COMPILED,
    record_rest,
    record_rest_id,
    rest_form,
)
from airflow_nats_ordered.core.publish.records import msg_id as derived_id
from airflow_nats_ordered.core.publish.run_layouts import OldLayout
from airflow_nats_ordered.core.publish.sender import _Sender
from airflow_nats_ordered.core.publish.sequence import SequenceMarks
from airflow_nats_ordered.core.publish.summary import PublishError, PublishSummary
from airflow_nats_ordered.core.stream.keys import key_header_line
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, describe
from airflow_nats_ordered.core.stream.partitioning import HASH_SEED, partition_wildcard

log = logging.getLogger(__name__)

#: the key cache of :meth:`OrderedPublisher.publish`: at most this many keys, each at most
#: this many UTF-8 bytes (a few MB at most; typical keys take well under 1 MB in all)
_KEY_CACHE_SIZE = 8192
_KEY_CACHE_KEY_BYTES = 256
_BASE62 = string.digits + string.ascii_letters


def _short_tag() -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(12))


class OrderedPublisher:
    """Publishes keyed records to a partitioned stream, in order per partition, exactly once.

    Usage::

        async with OrderedPublisher(nc, "ORDERS", producer_id=run_id) as pub:
            for rec in records:
                await pub.publish(rec["customer"], json.dumps(rec).encode())
        summary = pub.summary   # or: summary = await pub.flush()

    P, the subject prefix and the hash come from the stream metadata, never from the caller;
    ``expected_partitions`` only double-checks them.
    """

    def __init__(
        self,
        nc: NATS,
        stream: str,
        config: PublisherConfig | None = None,
        *,
        expected_partitions: int | None = None,
        start_after: Mapping[int, int] | None = None,
        fence: Mapping[int, int] | None = None,
        old_layout: OldLayout | None = None,
        **knobs: Any,
    ) -> None:
        if config is not None and knobs:
            raise TypeError("pass either config= or keyword knobs, not both")
        self.config = config or PublisherConfig(**knobs)
        #: partition -> positions a previous attempt of this run stored: the records given for
        #: them (the first n accepted of the partition, exactly as that attempt numbered them:
        #: refused records take no position) are passed over unsent, and the rest keep their
        #: positions and msg-ids. Exact however long ago that attempt ran.
        self.start_after = {int(p): int(n) for p, n in (start_after or {}).items() if n}
        #: partition -> the stream sequence its subject ended at when the caller read what
        #: earlier attempts stored (``start_after``); a partition left out had no message.
        #: Each partition's first stored record expects it (Nats-Expected-Last-Subject-
        #: Sequence): records an earlier attempt stored after that read (a failed attempt's
        #: late ones, past the duplicate window) are found and passed over, not stored twice.
        #: None (the default): no fence.
        self.fence = None if fence is None else {int(p): int(s) for p, s in fence.items()}
        #: a run begun before a repartition: the records the layout it was begun on stored
        #: are passed over, unsent (:mod:`.run_layouts`), counted in ``passed_over_old``
        self._old = old_layout
        self.passed_over_old = 0
        self.nc = nc
        self.stream_name = stream
        self.expected_partitions = expected_partitions
        self.stream: PartitionedStream  # set by start()
        self.summary: PublishSummary | None = None
        self._lanes: list[_Lane] = []
        self._sender = _Sender(self)  # serves parked lanes: acks and windows in one task
        self._pending = 0
        self._pending_bytes = 0
        self._space = asyncio.Event()
        self._batch_slots = asyncio.Semaphore(self.config.max_open_batches)
        self._slot_waiters = 0  # partitions waiting for a batch slot (lingerers yield to them)
        self._flushing = False
        self._closing = False
        self._started = False
        #: started, not closing, no old layout, no global order (_simple), and the compiled
        #: record form (_plain): a record of a key seen before may take publish()'s one-step
        #: path (publish_many's takes _simple)
        self._plain = self._simple = False
        self._refused = 0
        self._flushed_at: tuple[int, int, int] = (-1, -1, -1)
        self._rr = 0
        #: the place in the input of the last record handed to publish() (1-based)
        self._index = 0
        self._since_yield = 0
        self._counts_before: dict[str, int] = {}
        self._removed_before = 0
        self._t0 = 0.0
        self._sub: Any = None
        self._unwatch: Any = None
        self._run_tag = NUID().next().decode()
        # batch ids and the reply inbox are in every message's reply subject, which the
        # server parses per message: 12 random base62 characters (71 bits) keep them unique
        # per stream and connection at 20 bytes less per message than two NUIDs
        self._batch_tag = _short_tag()
        self._inbox = f"{inbox_prefix(nc)}.{self._batch_tag}"
        self._max_size = 0
        self._nparts = 0
        self._fast = False
        #: the producer id of this publisher's records: the configured one, or a unique one
        self.producer_id = self.config.producer_id or f"pub-{self._run_tag}"
        self._expect_duplicates = bool(self.config.producer_id)  # a rerun, maybe
        self._producer_b = self.producer_id.encode()
        self._id_base = msg_id_base(self._producer_b)  # the derived msg-ids' common prefix
        self._form = rest_form(self._producer_b)  # the same, and the frame rest's fixed parts
        # the header lines are %-format templates: a '%' of the producer id is escaped
        prod = b"%s: %s\r\n" % (HDR_PRODUCER.encode(), self._producer_b.replace(b"%", b"%%"))
        head = b"NATS/1.0\r\n%s: %%s\r\n" % HDR_MSG_ID.encode()
        tail = b"%s: %%d\r\n%s\r\n" % (HDR_SEQ.encode(), prod)
        # the key's header line (core/stream/keys.py, empty for a keyless record) goes in
        self._hdr_fmt = head + b"%s" + tail
        seq = self.config.global_order
        #: the header of the stream-wide sequence (global order), lower case; None without
        self._seq_header = seq.header.lower() if seq is not None else None
        if seq is not None:  # the global sequence goes after the producer line
            self._hdr_fmt = self._hdr_fmt[:-2] + b"%s: %%d\r\n\r\n" % seq.header.encode()
        # without caller headers or global order, a record's _Rec frame rest is one format:
        # its header block's length is known before it is built (the sequence goes in as text)
        tail_s = b"%s: %%s\r\n%s\r\n" % (HDR_SEQ.encode(), prod)
        self._rest_fmt = b".1.$FI %d %d\r\n" + head + b"%s" + tail_s + b"%s\r\n"
        self._hdr_len0 = len((head + tail_s) % (b"", b""))  # without msg-id, key line, seq
        #: key -> (UTF-8 bytes, header line, partition) of str keys seen before, so a repeated
        #: key skips the checks, the encoding and the hash (bounded: cleared when full)
        self._keys: dict[object, tuple[bytes, bytes, int]] = {}
        self._next_g = 0  # the next global sequence (global_order): set by start()
        self._watermarks: SequenceMarks | None = None

    async def __aenter__(self) -> OrderedPublisher:
        await self.start()
        return self

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is None:
            await self.close()
        else:
            await self.close(raise_on_failure=False)

    async def start(self) -> None:
        if self._started:
            return
        self.stream = await describe(self.nc, self.stream_name)
        if self.expected_partitions is not None and (
            self.expected_partitions != self.stream.partitions
        ):
            raise PartitionMismatchError(
                f"stream {self.stream.name} has {self.stream.partitions} partitions in its "
                f"metadata but {self.expected_partitions} were expected; the publisher always "
                "uses the stream's count: fix the expectation (or provision a new stream)"
            )
        if not self.stream.allow_batched:
            raise ConfigError(
                f"stream {self.stream.name} does not allow fast batch publishing; run "
                f"`nats-ordered provision --stream {self.stream.name} --partitions "
                f"{self.stream.partitions}` to enable it (a safe, in-place change)"
            )
        window, longest = self.stream.duplicate_window, self.config.longest_resend
        if window < longest:
            cfg = self.config
            raise ConfigError(
                f"stream {self.stream.name} de-duplicates msg-ids for {window:g}s "
                f"(duplicate_window), but this publisher may resend a record up to "
                f"{longest:g}s after sending it (delivery_timeout {cfg.delivery_timeout:g}s "
                f"+ ack_timeout {cfg.ack_timeout:g}s + {_MAX_BACKOFF:g}s backoff): a late "
                "resend would be stored again, after later records. Raise the stream's "
                f"window (`nats-ordered provision --stream {self.stream.name} --partitions "
                f"{self.stream.partitions} --duplicate-window {math.ceil(longest)}s`) or "
                "lower the publisher's delivery_timeout to at most "
                f"{max(0.0, window - cfg.ack_timeout - _MAX_BACKOFF):g}s"
            )
        self._nparts = self.stream.partitions
        self._fast = wire.supports_fast_path(self.nc)
        self._max_size = self.nc.max_payload
        if self.stream.max_msg_size and self.stream.max_msg_size > 0:
            self._max_size = min(self._max_size, self.stream.max_msg_size)
        self._counts_before, self._removed_before = await self._subject_counts()
        self._lanes = [_Lane(self, p) for p in range(self.stream.partitions)]
        for p, n in self.start_after.items():
            if not 0 <= p < len(self._lanes) or n < 0:
                raise ConfigError(
                    f"start_after names partition {p} with {n} records, but stream "
                    f"{self.stream.name} has partitions 0 to {len(self._lanes) - 1}"
                )
            self._lanes[p].resume_left = n
        if self.fence is not None:
            for lane in self._lanes:
                lane.fence = self.fence.get(lane.p, 0)
        if self.config.global_order:  # before any task starts: a failure here leaks none
            self._next_g, self._watermarks = await self.config.global_order.open(
                self.nc,
                self.stream,
                self.producer_id,
                self._idle_point,
                self.config.watermark_interval,
            )  # one global-order publisher at a time: SequencerBusy while another is
        self._unwatch = denials.watch(self.nc, self._denied)
        denials.expect(self.nc, f"{self._inbox}.>", *(lane.subject for lane in self._lanes))
        self._sub = await self.nc.subscribe(
            f"{self._inbox}.>",
            cb=self._on_reply,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        self._sender.start()
        for lane in self._lanes:
            lane.task = asyncio.ensure_future(lane.run())
        if self._watermarks is not None:
            await self._watermarks.write()  # every partition is idle: all advance to the base
            self._watermarks.start()
        self._t0 = time.monotonic()
        self._started = True
        self._simple = self._old is None and not self.config.global_order
        self._plain = COMPILED and self._simple

    def _denied(self, error: PermissionDenied) -> None:
        """The server refused a publish to a partition, or the replies' inbox: those
        partitions fail their records at once (a resend would be refused the same way)."""
        subject = error.subject.lower()
        # the replies' own subscription, exactly: a refused wildcard subscription of another
        # part of the program on this connection (an application's ``>``) is not this one's
        replies = f"{self._inbox}.>".lower()
        for lane in self._lanes:
            if (error.operation == "publish" and lane.subject.lower() == subject) or (
                error.operation == "subscribe" and subject == replies
            ):
                lane.deny(error)

    @property
    def denied(self) -> PermissionDenied | None:
        """Why partitions failed, if the server refused a permission this publisher needs
        (the first such refusal); None otherwise."""
        return next((lane.denied for lane in self._lanes if lane.denied is not None), None)

    def _idle_point(self) -> tuple[int, list[int]]:
        """The next global sequence and the partitions whose lane is idle (nothing queued,
        nothing awaiting its acknowledgement, no failure), in one synchronous step: every
        record of such a partition with a smaller sequence is stored (see :mod:`.sequence`)."""
        g = self._next_g
        return g, [
            lane.p
            for lane in self._lanes
            if lane.error is None and not lane.queue and not lane.inflight
        ]

    async def _on_reply(self, msg: Any) -> None:
        # <inbox>.<partition>.<batch id>.<flow>.fail.<seq>.<op>.$FI
        rest = msg.subject[len(self._inbox) + 1 :]
        p, _, tail = rest.partition(".")
        bid = tail.partition(".")[0]
        try:
            lane = self._lanes[int(p)]
        except (ValueError, IndexError):
            return
        lane.replies.append((bid, msg.data))
        if lane.parked:
            self._sender.kick(lane)
        else:
            lane.wake.set()

    async def _subject_counts(self, timeout: float = 5.0) -> tuple[dict[str, int], int]:
        """Messages per partition subject, and how many messages the stream ever removed
        (last sequence - messages): when it changes, limits or an operator removed some."""
        js = jetstream(self.nc, timeout=timeout)
        info = await js.stream_info(
            self.stream.name, subjects_filter=partition_wildcard(self.stream.prefix)
        )
        st = info.state
        return dict(st.subjects or {}), int(st.last_seq or 0) - int(st.messages or 0)

    def _release(self, n: int, nbytes: int) -> None:
        self._pending -= n
        self._pending_bytes -= nbytes
        self._space.set()

    # -- public API ---------------------------------------------------------------------------
    @property
    def partitions(self) -> int:
        return self.stream.partitions

    @property
    def accepted(self) -> int:
        return sum(lane.summary.accepted for lane in self._lanes)

    @property
    def acked(self) -> int:
        return sum(lane.summary.acked for lane in self._lanes)

    @property
    def failed(self) -> int:
        return sum(lane.summary.failed for lane in self._lanes)

    @property
    def refused(self) -> int:
        return self._refused

    def stored_positions(self) -> dict[int, int]:
        """Per partition, how many leading positions of this run are known stored: those
        passed over on resume plus those acknowledged so far (live: progress records)."""
        return {lane.p: lane.summary.offset + lane.summary.acked for lane in self._lanes}

    async def publish(
        self,
        key: str | bytes | None,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        index: int | None = None,
    ) -> int:
        """Queue one record; returns its partition.

        The record's derived msg-id (without ``msg_id``) is a digest of the producer id, its
        place in the input, its key and its payload (``docs/protocol.md``, section 6). The
        place is ``index`` when given (the record's 1-based index in the whole input, for a
        caller that does not hand every record over, e.g. passes some over itself), else
        one more than the last record's: every call counts, also for a record refused or
        passed over on resume (``start_after``), so a record's place is the same on every
        attempt over the same input.

        ``key`` reaches the worker's handler byte-exact (``Message.key``), in the header
        form :mod:`..stream.keys` chooses; it is refused with :class:`InvalidKeyError` when it is
        not text (invalid UTF-8) or longer than 4096 UTF-8 bytes. Raises
        :class:`MissingKeyError` (:class:`KeylessRecordError`) or
        :class:`RecordTooLargeError` for a bad record (nothing is sent and the publisher goes
        on). Waits while ``max_pending`` records or ``max_pending_bytes`` payload bytes are
        held. Concurrent calls (``asyncio.gather``) are safe: a record's place in the input
        is taken when the call starts, its position in its partition (``Nats-Ordered-Seq``)
        when it is accepted, after the wait. Delivery failures are
        reported by :meth:`flush`, not here.
        """
        if (
            self._plain
            and msg_id is None
            and headers is None
            and index is None
            and key.__class__ is str
            and data.__class__ is bytes  # the compiled form takes bytes, not any buffer
        ):
            # the common record, one step (the general path below does the same, check by
            # check): a key seen before, room in the bounds, a lane that takes it as it is
            known = self._keys.get(key)
            size = len(data)
            if (
                known is not None
                and self._pending < self.config.max_pending
                and self._pending_bytes + size <= self.config.max_pending_bytes
            ):
                kb, key_line, part = known
                lane = self._lanes[part]
                ls = lane.summary
                if not lane.resume_left and lane.error is None:
                    place = self._index + 1
                    one = record_rest(
                        self._form, place, kb, key_line, ls.offset + ls.accepted + 1, data
                    )
                    if one[2] <= self._max_size:  # else the general path raises
                        self._index = place
                        self._pending += 1
                        self._pending_bytes += size
                        ls.accepted += 1  # _Lane.accept, inlined
                        q = lane.queue
                        if not q:
                            lane.idle.clear()
                            if lane.parked:
                                self._sender.kick(lane)
                            else:
                                lane.wake.set()
                        q.append(one)
                        self._since_yield += 1
                        if self._since_yield >= 256:
                            self._since_yield = 0
                            await asyncio.sleep(0)
                        return part
        if not self._started:
            raise RuntimeError("call `await publisher.start()` (or use `async with`) first")
        if self._closing:
            raise RuntimeError("the publisher is closed")
        if index is None:
            self._index += 1
        elif index.__class__ is int and index > 0:
            self._index = index
        else:
            raise ValueError(f"index must be a record's 1-based place in the input, got {index!r}")
        place = self._index
        cfg = self.config
        known = self._keys.get(key) if key.__class__ is str else None
        if known is not None:  # a key seen before: its bytes, header line and partition
            kb, key_line, part = known
        elif key is None or key == "" or key == b"":
            if not cfg.allow_keyless:
                self._refused += 1
                raise KeylessRecordError()
            # round-robin, in call order: every keyless record counts (also one refused
            # below), so a record's partition follows from the input alone (run_layouts)
            turn = self._rr
            part = turn % self._nparts
            self._rr = turn + 1
            kb = key_line = b""
        else:
            try:
                kb, key_line = key_header_line(key)
            except InvalidKeyError:
                self._refused += 1
                raise
            part = mmh3.hash(kb, HASH_SEED, signed=False) % self._nparts
            if key.__class__ is str and len(kb) <= _KEY_CACHE_KEY_BYTES:
                if len(self._keys) >= _KEY_CACHE_SIZE:
                    self._keys.clear()
                self._keys[key] = (kb, key_line, part)
        if msg_id is not None:
            mid = msg_id.encode()
            if not mid or b"\r" in mid or b"\n" in mid or len(mid) > 256:
                self._refused += 1
                raise InvalidMsgIdError(
                    f"msg_id {msg_id!r} must be 1-256 characters without line breaks"
                )
        extra = b""
        if headers:
            for k in headers:
                if k.lower() in RESERVED_HEADERS or k.lower() == self._seq_header:
                    self._refused += 1
                    raise RecordError(f"header {k!r} is set by the publisher; remove it")
            try:
                extra = wire.header_block(headers)[10:-2]
            except ValueError as exc:
                self._refused += 1
                raise RecordError(str(exc)) from exc
        size = len(data)
        if size + len(kb) + len(extra) > self._max_size:  # too large whatever its headers
            raise self._too_large(kb, size + len(kb) + len(extra))
        if self._pending >= cfg.max_pending or self._pending_bytes + size > cfg.max_pending_bytes:
            # a record larger than max_pending_bytes goes alone, so progress is always made
            while self._pending >= cfg.max_pending or (
                self._pending_bytes and self._pending_bytes + size > cfg.max_pending_bytes
            ):
                self._space.clear()
                await self._space.wait()
        # from here to accept() nothing awaits: the position is taken atomically
        lane = self._lanes[part]
        seq = lane.summary.offset + lane.summary.accepted + 1
        rec: _Rec | None = None
        if (
            COMPILED
            and msg_id is None
            and not extra
            and not cfg.global_order
            and data.__class__ is bytes
        ):
            # the derived msg-id, the header block and the frame rest in one call (the
            # compiled records.record_rest; the pure path formats them here, as before)
            rec = record_rest(self._form, place, kb, key_line, seq, data)
            total = rec[2]
        else:
            if msg_id is None:  # msg_ids.msg_id_at, inlined
                h = self._id_base.copy()
                h.update(b"%d\x00%s\x00" % (place, kb))
                h.update(data)
                mid = hexlify(h.digest())
            else:
                lane.caller_ids = True
            if extra or cfg.global_order:  # the next global sequence: unless passed over
                g = (self._next_g,) if cfg.global_order else ()
                hdr = self._hdr_fmt % ((mid, key_line, seq) + g)
                if extra:
                    hdr = hdr[:-2] + extra + b"\r\n"
                hlen = len(hdr)
            else:  # header block and frame rest in one format, below
                hdr = None
                sb = b"%d" % seq
                hlen = self._hdr_len0 + len(mid) + len(key_line) + len(sb)
            total = hlen + size
        if total > self._max_size:
            raise self._too_large(kb, total)
        if self._old is not None and self._old.stored(kb, 0 if kb else turn):
            # the layout this run was begun on stored this record: pass it over, unsent
            self.passed_over_old += 1
            return part
        if lane.resume_left:
            # an earlier attempt of this run stored this position: pass it over, unsent
            lane.resume_left -= 1
            lane.summary.offset += 1
            if lane.resume_check is not None and not lane.resume_left:
                lane.check_passed_over(msg_id_of(rec[0]) if rec is not None else mid)
            return part
        if cfg.global_order:
            self._next_g += 1
        self._pending += 1
        self._pending_bytes += size
        # the frame after its reply subject's batch sequence (see _Rec): built once, however
        # often the record is sent
        if rec is None:
            if hdr is None:
                rest = self._rest_fmt % (hlen, total, mid, key_line, sb, data)
            else:
                rest = b".1.$FI %d %d\r\n%s%s\r\n" % (hlen, total, hdr, data)
            rec = (rest, size, total)
        if lane.error is None:  # _Lane.accept, inlined: this runs once per record
            lane.summary.accepted += 1
            q = lane.queue
            if not q:  # the lane waits for work only with an empty queue
                lane.idle.clear()
                if lane.parked:  # its batch is served by the sender
                    self._sender.kick(lane)
                else:
                    lane.wake.set()
            q.append(rec)
        else:
            lane.accept(rec)  # counted as failed at once
        self._since_yield += 1
        if self._since_yield >= 256:  # let the partition senders run while a producer loops
            self._since_yield = 0
            await asyncio.sleep(0)
        return part

    async def publish_many(self, records: Iterable[tuple[str | bytes | None, bytes]]) -> int:
        """Queue ``(key, payload)`` records, in order; returns how many were handed over.

        Exactly ``for key, data in records: await self.publish(key, data)``: the same places
        in the input, msg-ids, partitions, positions, waits and errors (a bad record raises
        here, after the records before it were queued, and none after it was taken). A
        record of a key seen before with room in the bounds is queued here without a
        coroutine of its own (as publish()'s one-step path, with the compiled or the pure
        record form); any other record goes through :meth:`publish`.
        """
        done = 0
        keys, lanes, form, cfg = self._keys, self._lanes, self._form, self.config
        max_pending, max_bytes = cfg.max_pending, cfg.max_pending_bytes
        for key, data in records:
            simple = self._simple and key.__class__ is str and data.__class__ is bytes
            known = keys.get(key) if simple else None
            size = len(data)
            if (
                known is None
                or self._pending >= max_pending
                or self._pending_bytes + size > max_bytes
            ):
                await self.publish(key, data)
                done += 1
                continue
            kb, key_line, part = known
            lane = lanes[part]
            ls = lane.summary
            rec = None
            if not lane.resume_left and lane.error is None:
                place = self._index + 1
                rec = record_rest(form, place, kb, key_line, ls.offset + ls.accepted + 1, data)
            if rec is None or rec[2] > self._max_size:
                await self.publish(key, data)  # it passes over, fails or refuses the record
                done += 1
                continue
            self._index = place
            self._pending += 1
            self._pending_bytes += size
            ls.accepted += 1  # _Lane.accept, inlined
            q = lane.queue
            if not q:
                lane.idle.clear()
                if lane.parked:
                    self._sender.kick(lane)
                else:
                    lane.wake.set()
            q.append(rec)
            done += 1
            self._since_yield += 1
            if self._since_yield >= 256:
                self._since_yield = 0
                await asyncio.sleep(0)
        return done

    async def publish_placed(
        self,
        keys: Sequence[str | bytes | None],
        payloads: Sequence[bytes],
        places: Sequence[int],
        *,
        ids: list[bytes],
        parts: list[int],
        refused: Callable[[int, RecordError], None] | None = None,
    ) -> None:
        """Queue records at given places in the input: exactly ``OrderedPublisher.publish(
        keys[i], payloads[i], index=places[i])`` for each ``i`` in order (the same msg-ids,
        partitions, positions, waits and refusals), handing back what a caller keeping its
        own record of the run needs without deriving it again.

        For every record ``publish`` would return for (accepted, or passed over on resume),
        its partition is appended to ``parts`` and its derived msg-id (hex, as bytes) to
        ``ids``. A refused record (:class:`RecordError`) is reported to ``refused(i,
        error)`` and the next one goes on (without ``refused`` it raises, after the records
        before it were queued). A record of a key seen before with room in the bounds is
        queued here without a coroutine of its own, its msg-id taken from its frame (one
        digest per record); any other through :meth:`publish`.
        """
        keycache, lanes, form, cfg = self._keys, self._lanes, self._form, self.config
        max_pending, max_bytes = cfg.max_pending, cfg.max_pending_bytes
        add_part = parts.append
        for i, (key, data, place) in enumerate(zip(keys, payloads, places, strict=True)):
            known = (
                keycache.get(key)
                if self._simple and key.__class__ is str and data.__class__ is bytes
                else None
            )
            if known is not None and place.__class__ is int and place > 0:
                size = len(data)
                kb, key_line, part = known
                lane = lanes[part]
                ls = lane.summary
                if (
                    self._pending < max_pending
                    and self._pending_bytes + size <= max_bytes
                    and not lane.resume_left
                    and lane.error is None
                ):
                    rec = record_rest_id(
                        form, place, kb, key_line, ls.offset + ls.accepted + 1, data, ids
                    )
                    if rec[2] <= self._max_size:
                        self._index = place
                        self._pending += 1
                        self._pending_bytes += size
                        ls.accepted += 1  # _Lane.accept, inlined
                        q = lane.queue
                        if not q:
                            lane.idle.clear()
                            if lane.parked:
                                self._sender.kick(lane)
                            else:
                                lane.wake.set()
                        q.append(rec)
                        add_part(part)
                        self._since_yield += 1
                        if self._since_yield >= 256:
                            self._since_yield = 0
                            await asyncio.sleep(0)
                        continue
                    ids.pop()  # too large: the general path refuses it
            try:  # it waits, passes over, fails or refuses the record (this class's
                # publish(), not a subclass's: the caller keeps its own record of the run)
                part = await OrderedPublisher.publish(self, key, data, index=place)
            except RecordError as exc:
                if refused is None:
                    raise
                refused(i, exc)
                continue
            kb = key.encode() if key.__class__ is str else bytes(key or b"")  # type: ignore[arg-type]
            ids.append(derived_id(form, place, kb, bytes(data)))
            add_part(part)

    def _too_large(self, kb: bytes, size: int) -> RecordTooLargeError:
        self._refused += 1
        return RecordTooLargeError(
            f"record with key {kb.decode()!r} is {size} bytes with headers, over the limit of "
            f"{self._max_size} bytes (server max_payload / stream max_msg_size); split the "
            "record or raise max_payload in the server configuration. Nothing was sent."
        )

    async def flush(self) -> PublishSummary:
        """Send and commit everything accepted so far; return the summary.

        Raises :class:`PublishError` (carrying the summary) if any record could not be stored.
        """
        if not self._started:
            raise RuntimeError("the publisher was not started")
        if self.summary is not None and self._flushed_at == self._flush_point():
            summary = self.summary  # nothing new since the last flush
        else:
            summary = await self._flush()
        if summary.failed or summary.unexpected_duplicates:
            errors = [lane.error for lane in self._lanes if lane.error]
            raise PublishError(summary, errors[0] if errors else None) from self.denied
        return summary

    async def _flush(self) -> PublishSummary:
        self._flushing = True
        try:
            for lane in self._lanes:
                lane.wake.set()
            await asyncio.gather(*(lane.until_idle() for lane in self._lanes))
        finally:
            self._flushing = False
        if self._watermarks is not None:  # everything is stored: every partition advances
            await self._watermarks.write()
        self.summary = await self._summarize()
        self._flushed_at = self._flush_point()
        return self.summary

    def _flush_point(self) -> tuple[int, int, int]:
        """What a flush has seen: records accepted, refused and passed over (a fence can
        move records from accepted to passed over)."""
        return self.accepted, self._refused, sum(ln.summary.offset for ln in self._lanes)

    async def _summarize(self) -> PublishSummary:
        """Per-partition counts; ``stored``/``duplicates`` stay None if the server is away."""
        parts = [lane.summary for lane in self._lanes]
        try:
            after, removed = await self._subject_counts(timeout=2.0)
        except (NatsError, TimeoutError):
            after = None
        if after is not None:
            exact = removed == self._removed_before  # nothing was removed meanwhile
            if not exact:
                log.warning(
                    "stream %s lost messages to its limits (or an operator) while publishing: "
                    "stored/duplicates counts are approximate",
                    self.stream.name,
                )
            for lane in self._lanes:
                s = lane.summary
                s.stored = after.get(lane.subject, 0) - self._counts_before.get(lane.subject, 0)
                s.duplicates = max(0, s.acked - s.stored)
                expected = self._expect_duplicates or lane.caller_ids or not exact
                s.unexpected_duplicates = 0 if expected else max(0, s.duplicates - s.resent)
            # a partition whose records were all duplicates, or all passed over on resume
            # (an earlier attempt stored them), got no stream sequence back: its high-water
            # mark is the partition's last message
            missing = [
                ln
                for ln in self._lanes
                if (ln.summary.acked or ln.summary.offset) and not ln.summary.last_seq
            ]
            js = jetstream(self.nc)

            async def last(lane: _Lane) -> None:
                with contextlib.suppress(NatsError, TimeoutError):
                    msg = await js.get_last_msg(self.stream.name, lane.subject, direct=True)
                    lane.summary.last_seq = int(msg.seq or 0)

            await asyncio.gather(*(last(ln) for ln in missing))
        return PublishSummary(
            stream=self.stream.name,
            partitions=parts,
            refused=self._refused,
            elapsed=time.monotonic() - self._t0,
        )

    async def close(self, raise_on_failure: bool = True) -> PublishSummary | None:
        """Flush, stop the partition tasks and drop the reply subscription."""
        if not self._started or self._closing:
            return self.summary
        summary: PublishSummary | None = None
        for lane in self._lanes:  # the input has ended
            lane.check_resume_done()
        try:
            summary = await self.flush()
        except PublishError as exc:
            summary = exc.summary
            if raise_on_failure:
                raise
        finally:
            self._closing = True
            self._plain = self._simple = False
            if self._unwatch is not None:
                self._unwatch()
            if self._watermarks is not None:
                await self._watermarks.close()
            for lane in self._lanes:
                lane.wake.set()
            for lane in self._lanes:
                if lane.task is not None:
                    lane.task.cancel()
            await asyncio.gather(
                *(lane.task for lane in self._lanes if lane.task), return_exceptions=True
            )
            await self._sender.stop()
            if self._sub is not None:
                with contextlib.suppress(NatsError):
                    await self._sub.unsubscribe()
        return summary


__all__ = [
    "OrderedPublisher",
]
