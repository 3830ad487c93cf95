"""Pipelined compare-and-set writes to a KV bucket (:class:`CasWrites`).

Guarantees: :meth:`CasWrites.send` makes the write ``KeyValue.update`` makes (the same
subject, value and ``Nats-Expected-Last-Subject-Sequence`` header, so the server checks the
same revision), but returns as soon as the write is on the wire; the server's answer is
given to the write's callback exactly once: the new revision, or the error (an
:class:`APIError`, err_code 10071 when the compare-and-set failed;
:class:`~nats.errors.NoRespondersError`; :class:`TimeoutError` when no answer came within
the write's timeout, after which a late answer is dropped;
:class:`~..errors.PermissionDenied` instead when the server refused the write or its
answers' inbox, see :mod:`~..connection.denials`).

Why not ``KeyValue.update`` in a task: on a busy event loop (a synchronous handler works
through a time slice per partition) the task would run, and nats-py's flusher task would
put the write on the wire, only after every other ready task's turn; a member killed
meanwhile loses every commit still waiting in its process. Here the client's buffer is
written to the socket at once (:func:`flush_now`; over a websocket at the flusher's next
turn, as ``KeyValue.update`` would), and the answers come through the connection's fast
route (:func:`~..stream.reader._route`), i.e. from the task reading the socket, so a callback can
send the write queued behind without waiting for another turn.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.transport import TcpTransport
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.stream.reader import _route

log = logging.getLogger(__name__)

#: the header of a compare-and-set on a KV key's last revision
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
_EXPECTED = EXPECTED_LAST_SUBJECT_SEQ.encode()

#: a write's callback: the new revision, or why there is none
Answer = Callable[[int | BaseException], Awaitable[None]]

#: answers delivered from timers (a reference keeps each task alive until it ends)
_LATE: set[asyncio.Task[None]] = set()


def _socket_of(nc: NATS) -> TcpTransport | None:
    """The client's socket, when what it buffers may be written to it directly: connected,
    over TCP (with or without TLS), with the buffer this code knows (a list and its size).
    None otherwise: a websocket (``ws://``, ``wss://``) only queues what it is given until
    ``drain()``, which nats-py's flusher calls only while its own buffer holds something,
    so a write handed to it here would stay unsent until some other publish."""
    transport = getattr(nc, "_transport", None)
    if not isinstance(getattr(nc, "_pending", None), list):
        return None
    if not isinstance(transport, TcpTransport) or not nc.is_connected:
        return None
    return transport if hasattr(nc, "_pending_data_size") else None


def _write_pending(nc: NATS, transport: TcpTransport, *after: bytes) -> None:
    """Write the client's buffer, then ``after``, and empty the buffer."""
    transport.writelines([*nc._pending, *after])
    nc._pending = []
    nc._pending_data_size = 0


def flush_now(nc: NATS) -> None:
    """Write what the client has buffered to its socket now (what nats-py's flusher task
    does at its next turn, in the same order). A no-op when there is nothing buffered or
    the buffer cannot be written directly (:func:`_socket_of`)."""
    transport = _socket_of(nc)
    if transport is not None and nc._pending:
        _write_pending(nc, transport)


def _send_now(nc: NATS, cmd: bytes, payload_size: int) -> bool:
    """Write the protocol command ``cmd`` (a publish of ``payload_size`` bytes) to the
    socket now, after what the client has buffered (so the order of everything published
    is kept), as ``publish`` followed by :func:`flush_now` would, without waking nats-py's
    flusher task for it (a task switch per commit write). False, having written nothing,
    where :func:`flush_now` would not write (:func:`_socket_of`): publish it through the
    client then."""
    transport = _socket_of(nc)
    if transport is None:
        return False
    if nc._pending:
        _write_pending(nc, transport, cmd)
    else:
        transport.write(cmd)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += payload_size
    return True


class CasWrites:
    """Compare-and-set writes of one connection whose answers come back on one wildcard
    reply subscription (see the module docstring)."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._prefix: str | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[str, tuple[Answer, asyncio.TimerHandle]] = {}

    async def _open(self) -> str:
        async with self._lock:
            if self._prefix is None:
                prefix = f"{self.nc.new_inbox()}."
                sub = await self.nc.subscribe(f"{prefix}*", cb=self._on_msg)
                routes = _route(self.nc)
                if routes is not None:
                    routes[sub._id] = (self, None)
                self._prefix = prefix
        return self._prefix

    async def send(
        self, subject: str, value: bytes, last_revision: int, answer: Answer, timeout: float
    ) -> None:
        """Send the write of ``value`` to ``subject`` if the key's revision is still
        ``last_revision``; ``answer`` gets the new revision (or why there is none)."""
        prefix = self._prefix or await self._open()
        token = str(next(self._ids))
        denials.expect(self.nc, subject)  # a refusal names it as written
        timer = asyncio.get_running_loop().call_later(timeout, self._timed_out, token, subject)
        self._waiting[token] = (answer, timer)
        reply = prefix + token
        header = b"NATS/1.0\r\n%s: %d\r\n\r\n" % (_EXPECTED, last_revision)
        cmd = b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
            subject.encode(),
            reply.encode(),
            len(header),
            len(header) + len(value),
            header,
            value,
        )
        if _send_now(self.nc, cmd, len(value)):
            return
        try:
            await self.nc.publish(
                subject,
                value,
                reply=reply,
                headers={EXPECTED_LAST_SUBJECT_SEQ: str(last_revision)},
            )
        except BaseException:
            self._waiting.pop(token, None)
            timer.cancel()
            raise
        flush_now(self.nc)

    def _timed_out(self, token: str, subject: str) -> None:
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            # no answer: the server may have refused the write (or the answers' inbox)
            inbox = self._prefix + "*" if self._prefix else None  # the answers' subscription
            refused = denials.denied(self.nc, publish=subject, subscribe=inbox)
            task = asyncio.ensure_future(waiting[0](refused or TimeoutError()))
            _LATE.add(task)
            task.add_done_callback(_LATE.discard)

    async def _on_msg(self, msg: Any) -> None:
        waiting = self._waiting.pop(msg.subject[len(self._prefix or "") :], None)
        if waiting is None:
            return  # timed out already
        answer, timer = waiting
        timer.cancel()
        try:
            await answer(_result(msg))
        except Exception:  # never into the task reading the socket
            log.exception("handling the answer to a commit write failed")


def _result(msg: Any) -> int | BaseException:
    """The new revision a JetStream publish acknowledgement names, or its error."""
    if (msg.headers or {}).get("Status") == "503":
        return NoRespondersError()
    try:
        resp = json.loads(msg.data)
        err = resp.get("error")
        if err:
            return APIError(
                code=err.get("code"),
                err_code=err.get("err_code"),
                description=err.get("description"),
            )
        return int(resp["seq"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return APIError(description=f"unreadable answer {msg.data!r}: {exc}")
