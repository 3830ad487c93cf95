"""The fenced sink's errors: busy database, misuse, and a message out of order.

Guarantees: each names what happened and what to do; :class:`SinkOrderError` carries the
partition and sequence refused, and is raised only after nothing of the call was kept.
"""

from __future__ import annotations

from airflow_nats_ordered.core.errors import NatsOrderedError, OrderConflict


class SinkBusyError(NatsOrderedError, TimeoutError):
    """The sink database stayed locked by another writer for longer than ``timeout``."""


class SinkUsageError(NatsOrderedError):
    """The sink was used in a way that would break its guarantees (see the message)."""


class SinkOrderError(OrderConflict):
    """A message at or below the last applied sequence that is not a re-delivery of it.

    Applying it would break the partition's order and acknowledging it would lose it, so
    the call applied nothing (its verdict, OUT_OF_ORDER, is in the audit).
    """

    def __init__(self, message: str, *, partition: int, seq: int) -> None:
        super().__init__(message)
        self.partition = partition
        self.seq = seq
