"""Calling the worker's handler (:class:`HandlerCalls`, which the delivery has).

Guarantees: the handler is called under :data:`~..stream.continuity.delivering`, which maps each
message handed over to its Nats-Msg-Id (a fenced sink records it when the handler gives
no msg_id), and only while the call runs; an async handler, or an awaitable returned by
a synchronous one, is awaited under it too. What the handler raised is returned, to be
retried or dead-lettered by the caller, except cancellation, :class:`~..group.commits.Fenced`
(a newer owner exists) and :class:`~..errors.OrderConflict` (the sink can neither apply
nor skip the message), which propagate: those stop the partition without a retry or a
dead letter. A batch handler's :class:`~..errors.BatchFailed` says how many it applied.
"""

from __future__ import annotations

import inspect
from typing import Any

from airflow_nats_ordered.core.errors import BatchFailed, OrderConflict
from airflow_nats_ordered.core.group.commits import Fenced
from airflow_nats_ordered.core.stream.continuity import delivering
from airflow_nats_ordered.core.stream.message import HDR_MSG_ID, BatchHandler, Handler, Message


class HandlerCalls:
    """Calls of one handler for :class:`~.delivery.Delivery` (see the module)."""

    def __init__(self, handler: Handler | BatchHandler) -> None:
        self.handler = handler
        #: the handler is a coroutine function (or an object whose ``__call__`` is one)
        self.is_async = inspect.iscoroutinefunction(handler) or (
            callable(handler) and inspect.iscoroutinefunction(type(handler).__call__)
        )

    async def call(self, chunk: list[Message], batch: bool) -> tuple[int, Exception | None]:
        """Call the handler with ``chunk`` (the list in batch mode, else its one message)
        under :data:`~..stream.continuity.delivering` (the msg-ids handed over, for a sink the
        handler gives no msg_id): how many were applied, and the error (None: all).
        Cancellation, :class:`Fenced` and :class:`OrderConflict` propagate: a fenced sink,
        or a message the sink can neither apply nor skip, stops without retry or dead
        letter."""
        ids = {(m.partition, m.stream_seq): i for m in chunk if (i := m.headers.get(HDR_MSG_ID))}
        token = delivering.set(ids)
        try:
            arg: Any = chunk if batch else chunk[0]
            r = self.handler(arg)
            if self.is_async or (r is not None and inspect.isawaitable(r)):
                await r
            return len(chunk), None
        except (Fenced, OrderConflict):
            raise
        except BatchFailed as exc:
            return (min(exc.applied, len(chunk) - 1) if batch else 0), exc
        except Exception as exc:
            return 0, exc
        finally:
            delivering.reset(token)

    def call_one(self, m: Message) -> Any:
        """:meth:`call` of a synchronous handler with one message, without a coroutine:
        None once applied, the exception it raised, or the awaitable it returned (finish
        that with :meth:`finish_one`)."""
        i = m.headers.get(HDR_MSG_ID)
        token = delivering.set({(m.partition, m.stream_seq): i} if i else {})
        handler: Any = self.handler  # (a Handler: not in batch mode)
        try:
            r = handler(m)
        except (Fenced, OrderConflict):
            raise
        except Exception as exc:
            return exc
        finally:
            delivering.reset(token)
        return r if r is not None and inspect.isawaitable(r) else None

    async def finish_one(self, m: Message, r: Any) -> Exception | None:
        """Await what a synchronous handler returned for ``m`` (as :meth:`call` does)."""
        i = m.headers.get(HDR_MSG_ID)
        token = delivering.set({(m.partition, m.stream_seq): i} if i else {})
        try:
            await r
            return None
        except (Fenced, OrderConflict):
            raise
        except Exception as exc:
            return exc
        finally:
            delivering.reset(token)
