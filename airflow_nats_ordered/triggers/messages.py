"""``NatsMessageTrigger``: start DAG runs from JetStream messages (event-driven scheduling).

Use it in an ``AssetWatcher``, directly or as ``MessageQueueTrigger(scheme="nats", ...)``::

    Asset("orders", watchers=[AssetWatcher(name="orders", trigger=MessageQueueTrigger(
        scheme="nats", stream="ORDERS", subject="orders.p.>"))])

**Guarantee: at-least-once into asset events.** Every message stored in the stream (and
matching ``subject``) becomes at least one asset event; a message is acknowledged to
JetStream only after Airflow has stored the asset event(s) made from it. A duplicate
happens only after a failure (triggerer crash or restart, a lost ack, a NATS outage):
the message was stored as an asset event but not yet acknowledged, so JetStream
redelivers it. The payload's ``stream_seq`` (and ``msg_id``) identify a duplicate.

How: the trigger runs in Airflow 3.3's persistence-gated shared-stream *ack mode*
(:mod:`airflow.triggers.shared_stream`). :class:`NatsMessageProducer` reads a durable,
explicit-ack pull consumer and hands every message to the triggerer without
acknowledging it; Airflow calls :meth:`NatsMessageProducer.advance` once the asset
events are persisted, and only there is the message acked (confirmed by the server),
terminated (rejected by a subscriber) or nak'ed (failed: redelivered). Triggers with
exactly the same arguments share one consumer and one connection; a message is acked
only when every one of them has stored its event.

Airflow's "persisted" is not enough on its own: it also reports a message clean when
the trigger stopped after yielding its event but before the triggerer queued that event
for the database (the trigger task cancelled or failed while the triggerer logs "Trigger
fired event": leaving resolves the open event as accepted with nothing to confirm), and
when the event was queued after the shared stream had stopped (nothing gates it then).
So the filter also records each hand-over that reached Airflow's persistence gate
(:class:`Delivery`), and a message is acked only if every subscriber Airflow counts as
having accepted it handed it over that way; otherwise it is nak'ed and redelivered (a
duplicate at worst, never a loss). Nor does "persisted" mean stored for a trigger that
Airflow is removing (its row deleted or left without assets when the DAG was paused or
changed and parsed again: ``Trigger.submit_event`` then writes nothing); such a trigger
is cancelled in the same state sync that confirms those events, so a message handed over
by a trigger that is cancelled or due to be (:func:`trigger_removal_pending`) is nak'ed
too.

The durable consumer is the cursor: it survives triggerer restarts and is created on
first use (``deliver_policy`` decides where a *new* consumer starts). Messages handed
over but not yet advanced are kept alive with in-progress acks, so JetStream does not
redeliver them while Airflow persists; after a crash they come back ``ack_wait``
seconds later.

**Guarantee: every watcher gets every message, on any number of triggerers.** Airflow
stores one Trigger row per distinct set of trigger arguments (watchers with identical
arguments share the row, and each of their assets gets an event per message) and runs
each row on one triggerer (two, briefly, on a failover). A durable consumer is read by
one trigger *identity* (:func:`watcher_identity`: every serialized argument but
``durable``), never split between two, because JetStream hands each message of a
durable to only one of its readers:

* ``durable`` omitted: the consumer is ``airflow-watcher-<16 hex of the identity>``, so
  one Trigger row is one consumer. Changing any argument makes a new watcher with a new
  consumer, which starts at ``deliver_policy`` (default ``all``: every message the
  stream still holds becomes an asset event again - at-least-once, never a gap); the
  old consumer stays on the server until deleted (``nats consumer rm``).
* ``durable`` given: the consumer records the identity that binds it (consumer
  metadata ``airflow-nats-ordered.watcher-id``, nats-server >= 2.10). The same identity
  binds again (restart, failover, two triggerers running the one row); a different one
  is refused with an error naming the durable and the fix; a consumer without that
  record (made before this rule, or by hand) is adopted and keeps its position. After
  changing a watcher's arguments, :func:`release_durable` hands its consumer (and
  position) to the changed trigger. A refused trigger fails; the triggerer restarts it
  and logs the error again every heartbeat or so until the DAG is fixed, and its asset
  gets no events meanwhile (the messages stay with the consumer's bound watcher).

Two Airflow deployments sharing one NATS account and identical watcher arguments would
derive the same consumer name; give each deployment its own ``durable`` (or stream).

**What passes is waited for, a bad configuration fails.** Before it reads, the producer
waits (:meth:`NatsMessageProducer._ready`) while the stream does not exist yet (a
dead-letter stream before its first worker created it), the servers cannot be reached or
JetStream does not answer: one WARNING naming the stream, what creates it and the
connection, re-checks after 1 s doubling up to :data:`WAIT_MAX` (an ``asyncio.sleep``:
cancelling the trigger ends it at once), one INFO line once it reads. Without this the
trigger failed and the triggerer restarted it every ~2 s with the error each time.
Connection fields, refused credentials, a filter outside the stream's subjects or a
durable bound to another identity raise at once (and Airflow restarts the trigger, as
above). Once reading, nats-py reconnects a lost connection itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

import nats.errors
from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import AdvanceItem, SharedStreamProducer
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from airflow_nats_ordered.core.admin.dlq import DEAD_LETTER_SUFFIX
from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import AuthError, ConfigError, ConnectError, PermissionDenied
from airflow_nats_ordered.core.stream.partitioned import StreamSpec
from airflow_nats_ordered.core.worker.dead_letters import dead_letter_subject
from airflow_nats_ordered.hooks.arguments import refuse_unknown_arguments
from airflow_nats_ordered.hooks.nats import NatsHook, _in_airflow_terms, denial_in_airflow_terms

log = logging.getLogger(__name__)

CLASSPATH = "airflow_nats_ordered.triggers.messages.NatsMessageTrigger"

#: ``deliver_policy`` values: where a consumer created by the trigger starts
DELIVER_POLICIES: dict[str, api.DeliverPolicy] = {
    "all": api.DeliverPolicy.ALL,
    "new": api.DeliverPolicy.NEW,
    "last": api.DeliverPolicy.LAST,
    "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
}
_NAME_RE = re.compile(r"^[^.*>\s]+$")
#: consumer metadata keys: the identity hash of the trigger bound to it, and its arguments
BINDING_ID = "airflow-nats-ordered.watcher-id"
BINDING_ARGS = "airflow-nats-ordered.watcher-args"
DERIVED_PREFIX = "airflow-watcher-"
_JS_CONSUMER_EXISTS = 10148  # JetStream: create (action=create) of an existing consumer
#: seconds before the first re-check while the stream is missing or NATS cannot be reached,
#: doubled after each check up to :data:`WAIT_MAX` (see :meth:`NatsMessageProducer._ready`)
WAIT_FIRST = 1.0
WAIT_MAX = 30.0
#: errors of a server that is down, restarting or electing a JetStream leader: waited out
_PASSING_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError too: a request got no answer in time
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    ServiceUnavailableError,  # JetStream not (yet) available: 503
)


def watcher_identity(kwargs: dict[str, Any]) -> tuple[str, str]:
    """``(hash, canonical JSON)`` of a trigger's serialized kwargs without ``durable``.

    Equal for two triggers exactly when Airflow stores them as one Trigger row (it keys
    rows on the serialized kwargs), whatever durable they name: the unit that may read a
    durable consumer. The hash is the first 16 hex digits of the JSON's SHA-256."""
    args = {k: v for k, v in kwargs.items() if k != "durable"}
    text = json.dumps(args, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16], text


def message_payload(msg: Any) -> dict[str, Any]:
    """The JSON-safe TriggerEvent payload of one JetStream message.

    ``data`` is the text when the body is UTF-8 (``data_encoding: "utf-8"``), else its
    base64 (``data_encoding: "base64"``). ``redeliveries`` is 0 on the first delivery;
    ``msg_id`` is the ``Nats-Msg-Id`` header (the publisher's deduplication id) or None.
    """
    meta = msg.metadata
    headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
    try:
        data, encoding = msg.data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        data, encoding = base64.b64encode(msg.data).decode("ascii"), "base64"
    return {
        "stream": meta.stream,
        "subject": msg.subject,
        "stream_seq": meta.sequence.stream,
        "consumer": meta.consumer,
        "redeliveries": max(0, meta.num_delivered - 1),
        "timestamp": meta.timestamp.isoformat() if meta.timestamp else None,
        "msg_id": headers.get("Nats-Msg-Id"),
        "headers": headers,
        "data": data,
        "data_encoding": encoding,
    }


class NatsMessageTrigger(BaseEventTrigger):
    """Fires one TriggerEvent per message of ``stream`` (filtered by ``subject``).

    :param stream: the JetStream stream to read.
    :param durable: the durable consumer's name, the trigger's cursor across restarts.
        Omit it (the default) and the trigger reads its own ``airflow-watcher-<hash>``
        consumer, derived from all its other arguments. A durable given here is bound to
        the first trigger identity that reads it; another identity is refused (see the
        module docstring and :func:`release_durable`).
    :param subject: filter subject (wildcards allowed); default: every subject.
    :param nats_conn_id: the Airflow connection (type ``nats``).
    :param ack_wait: seconds before JetStream redelivers a message whose holder vanished
        (the delay before messages come back after a triggerer crash).
    :param batch: messages asked for per pull request.
    :param max_in_flight: messages handed to Airflow and not yet acknowledged, at most.
        Keep it below ``[triggerer] shared_stream_subscriber_queue_size`` (1024).
    :param deliver_policy: where a consumer created by the trigger starts: ``all``,
        ``new``, ``last`` or ``last_per_subject``. An existing consumer keeps its position.
    :param fetch_timeout: seconds a pull request waits for messages before the next one.

    Runs only as a shared stream in Airflow's triggerer (it needs the persistence-gated
    acknowledgements of Airflow >= 3.3); :meth:`run` refuses, see there.
    """

    def __init__(
        self,
        *,
        stream: str,
        durable: str | None = None,
        subject: str | None = None,
        nats_conn_id: str = NatsHook.default_conn_name,
        ack_wait: float = 30.0,
        batch: int = 100,
        max_in_flight: int = 256,
        deliver_policy: str = "all",
        fetch_timeout: float = 5.0,
        **unknown: Any,
    ) -> None:
        refuse_unknown_arguments("NatsMessageTrigger", unknown, NatsMessageTrigger.__init__)
        super().__init__()
        for name, value in (("stream", stream), ("durable", durable)):
            if name == "durable" and value is None:
                continue
            if not isinstance(value, str) or not _NAME_RE.match(value):
                raise ConfigError(
                    f"NatsMessageTrigger: {name}={value!r} is not a valid JetStream name; pass "
                    f"a non-empty {name} without '.', '*', '>' or whitespace"
                    + (
                        " (the durable consumer is what keeps the position)"
                        if name == "durable"
                        else ""
                    )
                )
        if deliver_policy not in DELIVER_POLICIES:
            raise ConfigError(
                f"NatsMessageTrigger: deliver_policy={deliver_policy!r} is not one of "
                f"{', '.join(DELIVER_POLICIES)}"
            )
        for name, number in (
            ("ack_wait", ack_wait),
            ("batch", batch),
            ("max_in_flight", max_in_flight),
            ("fetch_timeout", fetch_timeout),
        ):
            if not number > 0:
                raise ConfigError(f"NatsMessageTrigger: {name} must be > 0, got {number!r}")
        self.stream = stream
        self.durable = durable
        self.subject = subject or None
        self.nats_conn_id = nats_conn_id
        self.ack_wait = float(ack_wait)
        self.batch = int(batch)
        self.max_in_flight = int(max_in_flight)
        self.deliver_policy = deliver_policy
        self.fetch_timeout = float(fetch_timeout)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            CLASSPATH,
            {
                "stream": self.stream,
                "durable": self.durable,
                "subject": self.subject,
                "nats_conn_id": self.nats_conn_id,
                "ack_wait": self.ack_wait,
                "batch": self.batch,
                "max_in_flight": self.max_in_flight,
                "deliver_policy": self.deliver_policy,
                "fetch_timeout": self.fetch_timeout,
            },
        )

    @property
    def identity(self) -> str:
        """This trigger's :func:`watcher_identity` hash (the binding recorded on its consumer)."""
        return watcher_identity(self.serialize()[1])[0]

    @property
    def consumer_name(self) -> str:
        """The durable consumer read: ``durable``, or ``airflow-watcher-<identity>``."""
        return self.durable or f"{DERIVED_PREFIX}{self.identity}"

    def shared_stream_key(self) -> Hashable:
        """One consumer, one poll, for triggers with the same identity only.

        Triggers with other arguments (another Trigger row) never join a group: each
        binds the consumer itself, so a conflict on an explicit durable is refused the
        same way whether the two rows run on one triggerer or on two, and the producer
        built from one member's kwargs is right for every member."""
        return ("nats", self.stream, self.consumer_name, self.identity)

    @classmethod
    def create_shared_stream_producer(cls, kwargs: dict[str, Any]) -> NatsMessageProducer:
        return NatsMessageProducer(cls(**kwargs))

    async def filter_shared_stream(
        self, shared_stream: AsyncIterator[Any]
    ) -> AsyncIterator[TriggerEvent]:
        # One event per raw event, yielded before pulling the next one: that is what
        # binds the asset event to the message it came from (see shared_stream.py).
        async for delivery in shared_stream:
            yield TriggerEvent(dict(delivery))
            # Resumed: the triggerer has queued the event (a trigger stopped in between
            # never gets here). Only an event bound to the persistence gate counts.
            if isinstance(delivery, Delivery) and persistence_gated():
                delivery.handed_over()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Refuses: outside the triggerer's shared-stream ack mode nothing tells the trigger
        when Airflow has stored an event, so it would have to acknowledge a message before
        that and a triggerer stopping in between would lose it. Use the trigger in an
        ``AssetWatcher`` on Airflow >= 3.3 (the triggerer then runs it as a shared stream)."""
        raise RuntimeError(
            "NatsMessageTrigger only runs as a shared stream in Airflow's triggerer (ack mode, "
            "Airflow >= 3.3), where a message is acknowledged after Airflow stored its asset "
            "event; run() would acknowledge before that and can lose a message. Use it in an "
            "AssetWatcher (or MessageQueueTrigger(scheme='nats', ...)), not as a deferral "
            "trigger; to wait for a group to process messages use NatsGroupDrainSensor"
        )
        yield  # pragma: no cover - makes this an async generator


class Delivery(dict[str, Any]):
    """One delivery of a message as the producer hands it to the triggerer: its
    :func:`message_payload` (a ``dict``), plus the trigger tasks whose filters handed its
    event over to Airflow's persistence gate (:meth:`handed_over`)."""

    __slots__ = ("msg", "holders")

    def __init__(self, msg: Any) -> None:
        super().__init__(message_payload(msg))
        self.msg = msg
        self.holders: list[asyncio.Task | None] = []

    @property
    def handovers(self) -> int:
        """How many subscribers handed this delivery's event over to the persistence gate."""
        return len(self.holders)

    def handed_over(self) -> None:
        """Record that the calling trigger task's event for this delivery awaits Airflow's
        persistence confirmation (called by the filter once the triggerer took it)."""
        self.holders.append(asyncio.current_task())

    def holder_removed(self) -> bool:
        """Whether a trigger that handed this event over is cancelled, being cancelled or
        due to be (see :func:`trigger_removal_pending`)."""
        return any(task is not None and trigger_removal_pending(task) for task in self.holders)


def trigger_removal_pending(task: asyncio.Task) -> bool:
    """Whether the triggerer has stopped, is stopping, or has been told to stop the trigger
    running as ``task`` (its ``run_trigger`` task).

    Why it matters: Airflow's ``Trigger.submit_event`` stores an asset event for each
    asset the trigger row has *when the event is stored*; for a row deleted or left
    without assets (its DAG paused or changed, then parsed again) it stores nothing and
    the event is confirmed as persisted all the same. The triggerer deletes such a row
    in the round that "stored" the events and cancels the trigger in the state sync that
    confirms them: it queues the cancel (``TriggerRunner.to_cancel``) before it records
    the confirmations, so by the time a confirmation resolves a message the cancel is
    visible here. Reads the runner's ``to_cancel`` through the task's ``run_trigger``
    frame (Airflow 3.3 internals); without it only the task's own state counts."""
    if task.done() or task.cancelling():
        return True
    frame = getattr(task.get_coro(), "cr_frame", None)
    if frame is None:
        return False
    local = frame.f_locals
    to_cancel = getattr(local.get("self"), "to_cancel", None)
    try:
        return to_cancel is not None and local.get("trigger_id") in to_cancel
    except TypeError:  # pragma: no cover - another Airflow's internals
        return False


def persistence_gated() -> bool:
    """Whether the event the triggerer just took from the running filter is bound to
    Airflow's persistence gate: Airflow confirms it only once the event is stored.

    Call it from ``filter_shared_stream`` right after the ``yield`` returned. False when
    the triggerer queued the event with nothing to confirm (the shared stream had
    stopped: Airflow would report the message clean without storing it). Reads the
    shared stream's open binding window (Airflow 3.3's ``_reject_context``); if those
    internals are not there, resuming past the yield is taken as the evidence."""
    try:
        from airflow.triggers import shared_stream

        window = shared_stream._reject_context.get()
        if window is None:
            return True  # not ack mode: nothing will be acked from this event anyway
        entry = window.group._outstanding.get(window.event_id)
        binding = entry.bindings.get(window.trigger_id) if entry is not None else None
        # bound and not yet confirmed: nothing awaited between the bind and this call
        return binding is not None and bool(binding.unconfirmed_seqs)
    except AttributeError:  # pragma: no cover - another Airflow's internals
        return True


class NatsMessageProducer(SharedStreamProducer):
    """The broker side of :class:`NatsMessageTrigger`'s shared stream (ack mode).

    Guarantees: a message is acked only in :meth:`advance` with a clean outcome (every
    subscriber's asset event persisted) *and* a hand-over to the persistence gate by as
    many subscribers as Airflow counts as having accepted it (:class:`Delivery`), and the
    ack is confirmed by the server; a rejected message is terminated (never redelivered);
    a failed one, one nobody accepted, or a clean one without those hand-overs, is
    nak'ed and redelivered. A message never advanced (crash, stop) is redelivered by
    JetStream ``ack_wait`` after its holder disappeared. At most ``max_in_flight``
    messages are outstanding.
    """

    def __init__(self, trigger: NatsMessageTrigger) -> None:
        self.t = trigger
        self._stack = contextlib.AsyncExitStack()
        # id(Msg) -> the Delivery handed to the triggerer and not advanced yet (keyed by
        # the delivery, not the stream sequence: a redelivered copy is another delivery)
        self._outstanding: dict[int, Delivery] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._keepalive: asyncio.Task | None = None
        self._nc: Any = None
        self._sub: Any = None

    def _consumer_config(self) -> api.ConsumerConfig:
        t = self.t
        identity, args = watcher_identity(t.serialize()[1])
        return api.ConsumerConfig(
            name=t.consumer_name,
            durable_name=t.consumer_name,
            description="airflow-nats-ordered NatsMessageTrigger (Airflow asset watcher)",
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=t.ack_wait,
            deliver_policy=DELIVER_POLICIES[t.deliver_policy],
            filter_subject=t.subject,
            max_deliver=-1,
            max_ack_pending=t.max_in_flight,
            metadata={BINDING_ID: identity, BINDING_ARGS: args},
        )

    async def _ensure_consumer(self, js: Any) -> None:
        """Create the durable consumer bound to this trigger's identity, or bind to an
        existing one: it must read what was asked, and be bound to this identity or to
        none (adopted: its position is kept). Another identity's consumer is refused."""
        t = self.t
        try:
            stream = await js.stream_info(t.stream)
        except NotFoundError:
            raise _StreamMissing from None
        subjects = list(stream.config.subjects or [])
        # nats-server accepts a filter that matches none of the stream's subjects: the
        # watcher would read nothing, silently. (A stream without subjects of its own, a
        # mirror or a sourced stream, stores its sources' subjects: not checked.)
        if t.subject and subjects and not any(_overlap(t.subject, s) for s in subjects):
            raise ConfigError(
                f"NatsMessageTrigger: subject={t.subject!r} matches none of the subjects of "
                f"stream {t.stream!r} ({', '.join(subjects)}), so the watcher would never get "
                "a message; fix subject= (for dead_letter_trigger: the group and the "
                "subject_prefix of the partitioned stream)"
            )
        try:
            info = await js.consumer_info(t.stream, t.consumer_name)
        except NotFoundError:
            try:
                if await _create_only(js, t.stream, self._consumer_config()):
                    return
            except BadRequestError as e:
                raise ConfigError(
                    f"NatsMessageTrigger: stream {t.stream!r} refused to create consumer "
                    f"{t.consumer_name!r} (subject={t.subject!r}): {e.description}"
                ) from None
            # another trigger created it meanwhile: bind to it like to any existing one
            info = await js.consumer_info(t.stream, t.consumer_name)
        cfg = info.config
        have = cfg.filter_subject or (",".join(cfg.filter_subjects or []) or None)
        problems = []
        if have != t.subject:
            problems.append(f"filters subject {have!r}, not {t.subject!r}")
        if cfg.ack_policy != api.AckPolicy.EXPLICIT:
            problems.append(f"has ack policy {cfg.ack_policy}, not explicit")
        if cfg.deliver_subject:
            problems.append("is a push consumer, not a pull consumer")
        if problems:
            raise ConfigError(
                f"NatsMessageTrigger: consumer {t.consumer_name!r} of stream {t.stream!r} "
                f"{'; '.join(problems)}; pass another durable= (or delete that consumer)"
            )
        bound = (cfg.metadata or {}).get(BINDING_ID)
        if bound == t.identity:
            return
        if bound is not None:
            raise ConfigError(_bound_elsewhere(t, cfg.metadata or {}))
        # adopt: record the binding (and our ack_wait) in place, keeping the position
        mine = self._consumer_config()
        cfg.metadata = {**(cfg.metadata or {}), **(mine.metadata or {})}
        cfg.ack_wait = t.ack_wait
        await js.add_consumer(t.stream, config=cfg)
        log.info(
            "NatsMessageTrigger: adopted consumer %s of stream %s (bound to identity %s)",
            t.consumer_name,
            t.stream,
            t.identity,
        )
        again = (await js.consumer_info(t.stream, t.consumer_name)).config.metadata or {}
        if again.get(BINDING_ID) != t.identity:  # another trigger adopted it at once
            raise ConfigError(_bound_elsewhere(t, again))

    async def _ready(self) -> Any:
        """Connect and bind the consumer (:meth:`_ensure_consumer`); the JetStream context.

        Waits out what passes without anyone touching the watcher: the stream not created
        yet, the NATS servers unreachable, JetStream not answering. It checks again after
        :data:`WAIT_FIRST` seconds, doubling up to :data:`WAIT_MAX`, logs one WARNING when
        it starts waiting for a reason (see :func:`_wait_reason`) and one INFO line when
        it stops. The wait is ``asyncio.sleep``: the triggerer's loop runs on meanwhile,
        and cancelling the trigger (the shared stream's poll task) ends it at once.
        Anything else (bad connection fields, credentials refused, a consumer bound to
        another watcher, a filter outside the stream's subjects) raises: waiting would
        never end it."""
        t = self.t
        delay = WAIT_FIRST
        since: float | None = None  # monotonic time of the first failed attempt
        reasons: set[str] = set()  # the kinds of wait already logged
        while True:
            try:
                if self._nc is None:
                    hook = NatsHook(t.nats_conn_id)
                    self._nc = await self._stack.enter_async_context(hook.aconnect())
                js = jetstream(self._nc)
                await self._ensure_consumer(js)
                break
            except Exception as exc:
                reason = _wait_reason(t, exc)
                if reason is None:
                    denied = await self._denied(exc)
                    if denied is not None:
                        raise denied from exc
                    raise
                kind, text = reason
                if kind not in reasons:
                    reasons.add(kind)
                    log.warning("%s", text)
                if kind != "stream":  # a closed or stuck client is dropped: connect anew
                    await self._disconnect()
            since = since if since is not None else time.monotonic()
            await asyncio.sleep(delay)
            delay = min(delay * 2, WAIT_MAX)
        if since is not None:
            log.info(
                "NatsMessageTrigger: stream %s is there and consumer %s bound, after waiting "
                "%.0f s; reading it",
                t.stream,
                t.consumer_name,
                time.monotonic() - since,
            )
        return js

    async def _denied(self, exc: BaseException) -> PermissionDenied | None:
        """A refused permission behind ``exc``, worded for the trigger's connection."""
        hook = NatsHook(self.t.nats_conn_id)
        try:
            return denial_in_airflow_terms(exc, self.t.nats_conn_id, await hook.aget_options())
        except Exception:  # the connection could not be read again: the core's wording
            return None

    async def _disconnect(self) -> None:
        stack, self._stack, self._nc = self._stack, contextlib.AsyncExitStack(), None
        with contextlib.suppress(Exception):
            await stack.aclose()

    async def open_stream(self) -> AsyncIterator[tuple[Delivery, Any]]:
        """Connect (inside the running loop), waiting for the stream and the servers if
        need be (:meth:`_ready`), then yield ``(Delivery, msg)`` forever."""
        t = self.t
        js = await self._ready()
        sub = self._sub = await js.pull_subscribe_bind(t.consumer_name, stream=t.stream)
        self._keepalive = asyncio.create_task(
            self._keep_alive(), name=f"nats-wpi[{t.consumer_name}]"
        )
        log.info(
            "NatsMessageTrigger: reading stream %s subject %s with durable consumer %s",
            t.stream,
            t.subject or "(all)",
            t.consumer_name,
        )
        while True:
            await self._room.wait()
            # a refused pull or acknowledgement: fail, naming it, instead of fetching nothing
            # (or redelivering what Airflow stored) for ever
            refused = denials.latest(self._nc) if self._nc is not None else None
            if refused is not None:
                raise (await self._denied(refused)) or refused
            want = min(t.batch, t.max_in_flight - len(self._outstanding))
            try:
                msgs = await sub.fetch(want, timeout=t.fetch_timeout)
            except TimeoutError:  # nats.errors.TimeoutError too: nothing new yet
                continue
            for msg in msgs:
                delivery = self._outstanding[id(msg)] = Delivery(msg)
                if len(self._outstanding) >= t.max_in_flight:
                    self._room.clear()
                yield delivery, msg

    async def _keep_alive(self) -> None:
        """In-progress acks for handed-over messages, so JetStream does not redeliver them
        while Airflow persists (the triggerer's ack timeout can exceed ``ack_wait``)."""
        while True:
            await asyncio.sleep(self.t.ack_wait / 3)
            for delivery in list(self._outstanding.values()):
                with contextlib.suppress(Exception):
                    await delivery.msg.in_progress()

    async def advance(self, batch: Sequence[AdvanceItem]) -> None:
        """Ack (confirmed) the cleanly persisted messages, term the rejected, nak the rest.

        Clean means Airflow's outcome is clean and each subscriber it counts as having
        accepted the message handed its event over to the persistence gate; a clean
        outcome without that (the trigger stopped between yielding the event and the
        triggerer queueing it, or the stream had stopped) is nak'ed: Airflow never
        stored the event. So is a clean one handed over by a trigger that is cancelled
        or due to be (Airflow may have stored nothing for a trigger it is removing).
        Raises if an ack is not confirmed: Airflow then ends the shared stream and the
        message is redelivered (a duplicate, never a loss)."""
        clean: list[Any] = []
        rejected: list[Any] = []
        failed: list[Any] = []
        unstored: list[Any] = []
        removed: list[Any] = []
        for item in batch:
            msg = item.broker_payload
            delivery = self._outstanding.pop(id(msg), None)
            handovers = delivery.handovers if delivery is not None else 0
            if item.outcome.is_clean and handovers >= item.outcome.acked:
                gone = delivery is not None and delivery.holder_removed()
                (removed if gone else clean).append(msg)
            elif item.outcome.is_clean:
                unstored.append(msg)
            elif item.outcome.rejected:
                rejected.append(msg)
            else:
                failed.append(msg)
        if unstored:
            log.warning(
                "NatsMessageTrigger %s/%s: Airflow reported stream sequence(s) %s as stored "
                "but their events never reached its persistence gate (the trigger stopped "
                "while handing them over); nak'ed for redelivery",
                self.t.stream,
                self.t.consumer_name,
                [m.metadata.sequence.stream for m in unstored],
            )
            failed.extend(unstored)
        if removed:
            log.warning(
                "NatsMessageTrigger %s/%s: Airflow confirmed stream sequence(s) %s as stored "
                "while it was removing the trigger (its row deleted or left without assets: "
                "the DAG paused or changed, or the trigger moved); Airflow stores no asset "
                "event for a removed trigger, so they are nak'ed for redelivery",
                self.t.stream,
                self.t.consumer_name,
                [m.metadata.sequence.stream for m in removed],
            )
            failed.extend(removed)
        if len(self._outstanding) < self.t.max_in_flight:
            self._room.set()
        await asyncio.gather(*(m.term() for m in rejected), *(m.nak() for m in failed))
        await asyncio.gather(*(m.ack_sync(timeout=max(5.0, self.t.fetch_timeout)) for m in clean))
        if rejected or failed:
            log.warning(
                "NatsMessageTrigger %s/%s: %d message(s) terminated (rejected), %d nak'ed "
                "for redelivery (not persisted by Airflow)",
                self.t.stream,
                self.t.consumer_name,
                len(rejected),
                len(failed),
            )

    async def aclose(self) -> None:
        """Nak what Airflow never advanced (redelivered now rather than after ``ack_wait``),
        stop the keep-alive and close the connection. Called after the last advance."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        abandoned = [delivery.msg for delivery in self._outstanding.values()]
        self._outstanding = {}
        with contextlib.suppress(Exception):
            if self._sub is not None:
                # first end our pull request's interest, or the server would hand the
                # nak'ed messages straight back to this dying subscription
                await self._sub.unsubscribe()
                await self._nc.flush(timeout=5)
            if abandoned:
                await asyncio.gather(*(m.nak() for m in abandoned))
                await self._nc.flush(timeout=5)  # the server has the naks before we close
        await self._stack.aclose()


def _overlap(a: str, b: str) -> bool:
    """Whether some subject matches both NATS subject patterns ``a`` and ``b``."""
    x, y = a.split("."), b.split(".")
    for p, q in zip(x, y, strict=False):
        if p == ">" or q == ">":  # the rest of the other one: one or more tokens
            return True
        if p != q and "*" not in (p, q):
            return False
    return len(x) == len(y)  # tokens left over in one: a subject matches only one length


class _StreamMissing(Exception):
    """The trigger's stream does not exist (yet): waited for, see :func:`_wait_reason`."""


def _wait_reason(t: NatsMessageTrigger, exc: Exception) -> tuple[str, str] | None:
    """``(kind, the WARNING to log once)`` if ``exc`` passes by waiting; None if it does
    not (a bad configuration: the trigger fails with it)."""
    retry = f"checking again with backoff up to {WAIT_MAX:.0f} s"
    if isinstance(exc, _StreamMissing):
        base = t.stream.removesuffix(DEAD_LETTER_SUFFIX)
        if t.stream.endswith(DEAD_LETTER_SUFFIX) and base:
            why = (
                f"it is the dead-letter stream of {base!r}, created when the first worker of "
                f"a group of {base!r} starts with the poison policy dead-letter (the default "
                "of `nats-ordered worker` and `nats-ordered pool`), or when a global-order "
                "reader first sets a record aside; until then there are no dead letters"
            )
        else:
            why = (
                "create it (`nats-ordered provision`, or `nats stream add`), or fix stream= "
                "if the name is wrong"
            )
        return "stream", (
            f"NatsMessageTrigger: stream {t.stream!r} does not exist yet (connection "
            f"{t.nats_conn_id!r}): {why}. Waiting for it, {retry}; its messages become "
            f"asset events once it exists (consumer {t.consumer_name!r})"
        )
    if isinstance(exc, ConnectError) and not isinstance(exc, AuthError):
        return "connect", (
            f"NatsMessageTrigger: cannot reach NATS for stream {t.stream!r} (connection "
            f"{t.nats_conn_id!r}): {_in_airflow_terms(t.nats_conn_id, str(exc))} Waiting "
            f"for the servers, {retry}"
        )
    if isinstance(exc, _PASSING_ERRORS):
        return "jetstream", (
            f"NatsMessageTrigger: NATS JetStream does not answer for stream {t.stream!r} "
            f"(connection {t.nats_conn_id!r}: {type(exc).__name__}: {exc}; a server "
            "restarting or electing a leader, or JetStream not enabled for the account). "
            f"Waiting for it, {retry}"
        )
    return None


def _bound_elsewhere(t: NatsMessageTrigger, metadata: dict[str, str]) -> str:
    """The refusal: which durable, how the other binding differs, and the fixes."""
    ours = json.loads(watcher_identity(t.serialize()[1])[1])
    try:
        theirs = json.loads(metadata.get(BINDING_ARGS) or "")
        diff = [
            f"{k}={theirs.get(k)!r} there, {k}={ours.get(k)!r} here"
            for k in sorted(set(ours) | set(theirs))
            if theirs.get(k) != ours.get(k)
        ]
        how = "; ".join(diff) or f"identity {metadata.get(BINDING_ID)}"
    except ValueError:
        how = f"identity {metadata.get(BINDING_ID)}"
    return (
        f"NatsMessageTrigger: durable={t.consumer_name!r} of stream {t.stream!r} is bound "
        f"to another watcher's trigger with other arguments ({how}). Two triggers reading "
        "one durable consumer split its messages between them, so each watcher would miss "
        "some. Fix: omit durable= (each watcher then reads its own consumer and gets every "
        "message), or pass a durable= no other watcher uses. If this watcher's arguments "
        "were changed and the old trigger no longer runs, hand the consumer and its position "
        'over: python -c "from airflow_nats_ordered.triggers.messages import '
        f"release_durable; release_durable({t.stream!r}, {t.consumer_name!r}, "
        f'nats_conn_id={t.nats_conn_id!r})"'
    )


async def _create_only(js: Any, stream: str, config: api.ConsumerConfig) -> bool:
    """Create the consumer only if it does not exist (JetStream ``action: create``, so
    two triggers racing cannot overwrite each other's binding); False if it exists."""
    req = {"stream_name": stream, "config": config.as_dict(), "action": "create"}
    subject = f"{js._prefix}.CONSUMER.CREATE.{stream}.{config.name}"
    if config.filter_subject and config.filter_subject != ">":
        subject += f".{config.filter_subject}"
    try:
        await js._api_request(subject, json.dumps(req).encode(), timeout=js._timeout)
    except BadRequestError as e:
        if e.err_code == _JS_CONSUMER_EXISTS:
            return False
        raise
    return True


async def arelease_durable(nc: Any, stream: str, durable: str) -> bool:
    """Remove the binding recorded on consumer ``durable`` of ``stream``; the next
    NatsMessageTrigger to read it adopts it at its position. False if it had none."""
    js = jetstream(nc)
    cfg = (await js.consumer_info(stream, durable)).config
    metadata = dict(cfg.metadata or {})
    if metadata.pop(BINDING_ID, None) is None:
        return False
    metadata.pop(BINDING_ARGS, None)
    cfg.metadata = metadata
    await js.add_consumer(stream, config=cfg)
    return True


def release_durable(
    stream: str, durable: str, nats_conn_id: str = NatsHook.default_conn_name
) -> bool:
    """Hand durable consumer ``durable`` to the next trigger that reads it, position kept.

    For a watcher whose arguments changed (a new Trigger row) while its ``durable=``
    stayed: run it once the old trigger no longer runs (the DAG change is deployed).
    Run it while the old trigger still reads the consumer and whichever binds first
    wins, the other is refused again. Returns False if the consumer had no binding."""

    async def main() -> bool:
        async with NatsHook(nats_conn_id).aconnect() as nc:
            return await arelease_durable(nc, stream, durable)

    return asyncio.run(main())


def dead_letter_trigger(
    stream: str,
    group: str,
    *,
    subject_prefix: str | None = None,
    durable: str | None = None,
    nats_conn_id: str = NatsHook.default_conn_name,
    **kwargs: Any,
) -> NatsMessageTrigger:
    """A trigger on worker group ``group``'s dead-letter subject of partitioned ``stream``.

    Workers running with ``poison="dead-letter"`` publish a message that failed every
    retry to ``<prefix>.dlq.<group>.<partition>`` in stream ``<stream>_DLQ``, with headers
    ``Nats-Ordered-Error`` (why) and ``Nats-Ordered-Origin`` (JSON: stream, group,
    partition, seq). In an ``AssetWatcher`` this starts a triage DAG once per poison
    message (at least once). ``subject_prefix`` is the stream's, if it was provisioned
    with one; ``durable`` defaults to ``airflow-dlq-<group>`` (kept for the consumers
    existing deployments have: it is bound to the first triage watcher's arguments, so a
    second, different triage watcher of the group needs its own ``durable``); other
    keyword arguments go to :class:`NatsMessageTrigger` (unknown ones are refused).

    ``<stream>_DLQ`` is created by the group's first worker with ``poison="dead-letter"``
    (or a global-order reader's first record set aside); until then the trigger waits
    for it, logging that once (see the module docstring).
    """
    prefix = StreamSpec(name=stream, subject_prefix=subject_prefix).prefix
    # the core's subject of partition 0, with the partition token as a wildcard
    subject = dead_letter_subject(prefix, group, 0).rpartition(".")[0] + ".*"
    return NatsMessageTrigger(
        stream=f"{stream}_DLQ",
        subject=subject,
        durable=durable or f"airflow-dlq-{group}",
        nats_conn_id=nats_conn_id,
        **kwargs,
    )
