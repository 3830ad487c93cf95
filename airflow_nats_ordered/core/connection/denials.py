"""Permission violations a client received, and the operations they make fail.

A NATS server refuses a publish or a subscription the connected user may not make with
``-ERR 'Permissions Violation for Publish to "SUBJ"'`` (or ``Subscription to``), keeps
the connection, and drops what it refused. nats-py hands that only to the client's error
callback, so a request whose publish was refused, or whose reply inbox may not be
subscribed, just times out, and a long-running member retries a timeout for ever. Here
each violation becomes a :class:`~..errors.PermissionDenied` naming the subject:

* :func:`install` (``connect()`` calls it on every client it opens) makes the client's
  ``request`` (every JetStream API call, KV get and put, JetStream publish) fail with
  :class:`PermissionDenied` as soon as the server refuses its publish or its reply inbox,
  instead of timing out; :func:`record` (``connect()``'s error callback) keeps each
  violation on its client.
* :func:`denied` asks whether a publish to a subject, or a subscription receiving it, was
  refused on a client: what the parts that write or read without ``request`` (the
  publisher's lanes, the commit writes, the partition reader) ask when an answer is late.
* :func:`watch` calls back on every violation of a client: a running member stops with
  the error instead of retrying what can never pass, once :func:`concerns` says the
  refusal is of its own subjects (a connection may be shared: another part's refused
  subscription, such as an application's ``>``, is not the member's).
* :func:`forget` (``connect()``'s disconnected callback) drops what was refused: a new
  connection starts afresh (the server may have been given the permission meanwhile; what
  it still refuses, it refuses again when the client subscribes anew).

nats-py lowercases the server's error text; the subject is given back its case from the
request, subscription or :func:`expect`-ed subject it names (lowercase only if none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client

from airflow_nats_ordered.core.connection.api import api_prefix as _api_prefix
from airflow_nats_ordered.core.connection.api import inbox_prefix as _inbox_prefix
from airflow_nats_ordered.core.errors import PermissionDenied

__all__ = [
    "Violation",
    "concerns",
    "covers",
    "denied",
    "expect",
    "forget",
    "install",
    "latest",
    "record",
    "violations",
    "watch",
]

log = logging.getLogger(__name__)

_VIOLATION = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"\s']+)\"?", re.IGNORECASE
)
#: violations kept per client, and subjects remembered to give back their case
_KEEP = 64
_EXPECTED_MAX = 4096


@dataclass(frozen=True)
class Violation:
    """One refusal the server sent: ``operation`` (publish or subscribe) of ``subject``
    (given back its case where the client knew it, else as nats-py passed it: lowercase)."""

    operation: str
    subject: str

    def error(self, inbox_prefix: str | None = None) -> PermissionDenied:
        """This refusal as the error to raise; a refused reply inbox (under
        ``inbox_prefix``) asks for the whole prefix."""
        grant = None
        if inbox_prefix and self.subject.lower().startswith(inbox_prefix.lower() + "."):
            grant = f"{inbox_prefix}.>"
        return PermissionDenied(self.operation, self.subject, grant=grant)


class _Denials:
    """A client's violations, its pending requests and who watches."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.seen: deque[Violation] = deque(maxlen=_KEEP)
        #: violations received in all (``seen`` keeps the latest): a request asks only about
        #: those after it started, so one refused earlier is not blamed for its timeout
        self.total = 0
        #: lowercase subject -> the subject as the client wrote it
        self.expected: dict[str, str] = {}
        #: pending requests: task -> the lowercase subject it published to
        self.pending: dict[asyncio.Task[Any], str] = {}
        #: tasks cancelled here, and the error each is to raise instead
        self.cancelled: dict[asyncio.Task[Any], PermissionDenied] = {}
        self.watchers: list[Callable[[PermissionDenied], None]] = []

    def inbox_prefix(self) -> str:
        return _inbox_prefix(self.nc)

    def reply_subject(self) -> str | None:
        """The wildcard subscription every request's reply comes on (once made)."""
        raw = getattr(self.nc, "_resp_sub_prefix", None)
        return bytes(raw).decode() + "*" if raw else None

    def resolve(self, operation: str, lowered: str) -> str:
        if operation == "subscribe":
            for sub in list(getattr(self.nc, "_subs", {}).values()):
                subject = getattr(sub, "subject", "")
                if subject.lower() == lowered:
                    return str(subject)
            reply = self.reply_subject()
            if reply is not None and reply.lower() == lowered:
                return reply
        return self.expected.get(lowered, lowered)

    def find(
        self, operation: str, subject: str, exact: bool = False, since: int = 0
    ) -> Violation | None:
        """The latest refusal of ``operation`` on ``subject`` (for a subscription, unless
        ``exact``: of one whose pattern covers ``subject``, a message it would receive),
        among those received after the first ``since``."""
        low = subject.lower()
        recent = list(self.seen)[max(0, since - (self.total - len(self.seen))) :]
        for v in reversed(recent):
            if v.operation == operation and (
                v.subject.lower() == low
                or (operation == "subscribe" and not exact and covers(v.subject.lower(), low))
            ):
                return v
        return None

    def reply_denied(self, since: int = 0) -> PermissionDenied | None:
        reply = self.reply_subject()
        if reply is None:
            return None
        v = self.find("subscribe", reply, exact=True, since=since)
        return None if v is None else v.error(self.inbox_prefix())


def _state(nc: Client) -> _Denials:
    state: _Denials | None = getattr(nc, "_nor_denials", None)
    if state is None:
        state = _Denials(nc)
        nc._nor_denials = state  # type: ignore[attr-defined]
    return state


def covers(pattern: str, subject: str) -> bool:
    """Whether NATS subscription ``pattern`` (``*``, ``>``) covers ``subject``."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def install(nc: Client) -> None:
    """Make ``nc.request`` fail with :class:`PermissionDenied` once the server refused its
    publish or its reply inbox (at once, not after its timeout). Idempotent."""
    state = _state(nc)
    if getattr(nc, "_nor_request", None) is not None:
        return
    original = nc.request

    async def request(
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Any:
        refused = state.reply_denied()
        if refused is not None:
            raise refused
        task = asyncio.current_task()
        since = state.total
        if task is not None:
            state.pending[task] = subject.lower()
            state.expected.setdefault(subject.lower(), subject)
        try:
            return await original(
                subject, payload, timeout=timeout, old_style=old_style, headers=headers
            )
        except asyncio.CancelledError:
            error = state.cancelled.pop(task, None) if task is not None else None
            if error is None or task is None or task.uncancel() > 0:
                raise  # cancelled by someone else too: that cancellation wins
            raise error from None
        except nats.errors.TimeoutError:
            # only a refusal received while this request waited explains its timeout (one
            # of an earlier request may have been lifted since, by a config reload)
            published = state.find("publish", subject, since=since) is not None
            error = (
                PermissionDenied("publish", subject)
                if published
                else state.reply_denied(since=since)
            )
            if error is None:
                raise
            raise error from None
        finally:
            if task is not None:
                state.pending.pop(task, None)
                state.cancelled.pop(task, None)
                if len(state.expected) > _EXPECTED_MAX:
                    state.expected.clear()

    nc.request = request  # type: ignore[method-assign]
    nc._nor_request = request  # type: ignore[attr-defined]


def record(nc: Client, exc: BaseException) -> Violation | None:
    """Keep ``exc`` if it is a permission violation (None otherwise): fail the pending
    requests it refused, tell the watchers, log it once."""
    match = _VIOLATION.search(str(exc))
    if match is None:
        return None
    state = _state(nc)
    operation = "publish" if match[1].lower() == "publish" else "subscribe"
    lowered = match[2].lower()
    v = Violation(operation, state.resolve(operation, lowered))
    state.seen.append(v)
    state.total += 1
    error = v.error(state.inbox_prefix())
    log.warning("NATS refused a %s: %s", operation, error.permission)
    reply = state.reply_subject()
    every = operation == "subscribe" and reply is not None and reply.lower() == lowered
    for task, subject in list(state.pending.items()):
        if (every or (operation == "publish" and subject == lowered)) and not task.done():
            state.cancelled[task] = error
            task.cancel()
    for callback in list(state.watchers):
        try:
            callback(error)
        except Exception:  # never into nats-py's read loop
            log.exception("a permission-violation callback failed")
    return v


def expect(nc: Client, *subjects: str) -> None:
    """Remember ``subjects`` (written without ``request``: raw publishes, inboxes) so a
    violation naming one of them is reported with its case."""
    expected = _state(nc).expected
    if len(expected) > _EXPECTED_MAX:
        expected.clear()
    for subject in subjects:
        expected[subject.lower()] = subject


def denied(
    nc: Client, *, publish: str | None = None, subscribe: str | None = None
) -> PermissionDenied | None:
    """The error for a refused publish to ``publish``, or the refused subscription
    ``subscribe`` (the caller's own subscription subject, matched exactly: a refused wildcard
    subscription of another part of the program, e.g. ``>``, is not the caller's), if the
    server sent one on ``nc`` since it last connected; else None."""
    state: _Denials | None = getattr(nc, "_nor_denials", None)
    if state is None or not state.seen:
        return None
    if publish is not None:
        v = state.find("publish", publish)
        if v is not None:
            return PermissionDenied("publish", publish)
    if subscribe is not None:
        v = state.find("subscribe", subscribe, exact=True)
        if v is not None:
            return v.error(state.inbox_prefix())
    return None


def latest(nc: Client) -> PermissionDenied | None:
    """The error of the latest violation ``nc`` received (None: none), for a loop that
    reads without requests and would otherwise wait for ever for what was refused."""
    state: _Denials | None = getattr(nc, "_nor_denials", None)
    if state is None or not state.seen:
        return None
    return state.seen[-1].error(state.inbox_prefix())


def violations(nc: Client) -> list[Violation]:
    """The violations ``nc`` received (the latest, at most 64), oldest first."""
    state: _Denials | None = getattr(nc, "_nor_denials", None)
    return list(state.seen) if state is not None else []


def forget(nc: Client) -> None:
    """Drop the violations ``nc`` received: its connection is gone, and with it every
    subscription the server refused (a reconnect subscribes anew, and the server refuses
    again what it still refuses). Without this, a reply inbox refused once would fail every
    request for the client's lifetime, even after the user was given the permission."""
    state: _Denials | None = getattr(nc, "_nor_denials", None)
    if state is not None:
        state.seen.clear()


def concerns(
    nc: Client,
    error: PermissionDenied,
    *,
    names: Iterable[str] = (),
    prefixes: Iterable[str] = (),
) -> bool:
    """Whether refusal ``error`` on ``nc`` is of a part that uses the JetStream objects
    ``names`` (streams, ``KV_<bucket>`` streams, buckets: a refused JetStream API, KV,
    acknowledgement or flow-control subject naming one of them), publishes under
    ``prefixes`` (e.g. a group's dead-letter subjects), or receives on the client's reply
    inboxes (a refused subscription under its inbox prefix). A connection may be shared:
    what another part of the program was refused (an application's ``>`` subscription, a
    publish to another stream) is not that part's, and must not stop it."""
    subject = error.subject.lower()
    if error.operation == "subscribe":
        return covers(f"{_inbox_prefix(nc)}.>".lower(), subject)
    tokens = set(subject.split("."))
    lowered = {n.lower() for n in names}
    if subject.startswith(("$js.", "$kv.", _api_prefix(nc).lower() + ".")) and tokens & lowered:
        return True
    return any(subject.startswith(p.lower() + ".") for p in prefixes)


def watch(nc: Client, callback: Callable[[PermissionDenied], None]) -> Callable[[], None]:
    """Call ``callback`` (synchronously, from the task reading the socket: it must not
    block) with the error of every violation ``nc`` receives from now on; returns the
    function that stops it."""
    watchers = _state(nc).watchers
    watchers.append(callback)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            watchers.remove(callback)

    return stop
