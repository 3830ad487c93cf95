"""Which errors fail an Airflow task at once, and which ones a retry may fix.

Airflow retries a failed task ``retries`` times, ``retry_delay`` apart, unless the task
raises :class:`~airflow.sdk.exceptions.AirflowFailException`. An error that comes back the
same on every try (a malformed argument, a refused record, a stream that does not exist, a
partition count that differs, a partition blocked on a poison message) only delays the
failure and hides its message behind the retries, so the operators and the drain sensor
raise those as ``AirflowFailException`` with the original message (the original error is
its ``__cause__``, shown in the task log's traceback). Everything else stays retryable: a
server nobody answers on, a timeout, records not confirmed as stored (a retry resumes the
run without storing anything twice), a group with no state yet or no live member (its
workers may be starting).

docs/airflow.md lists the same decisions in a table.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_nats_ordered.core.admin.drain_errors import PartitionBlockedError, StrayMessagesError
from airflow_nats_ordered.core.errors import (
    AuthError,
    ConfigError,
    PermissionDenied,
    RecordError,
    StreamConflictError,
    StreamNotFoundError,
)
from airflow_nats_ordered.core.group.stream_identity import StateWentBack, StreamRecreated
from airflow_nats_ordered.core.worker.presence import GroupDeletedError

#: errors no retry can fix: the next try meets the same arguments, input, credentials and
#: stream, so it fails the same way. Subclasses count too (PartitionMismatchError is a
#: StreamConflictError, InputError and KeyTextError are ConfigErrors).
UNFIXABLE: tuple[type[BaseException], ...] = (
    ConfigError,  # a malformed argument, setting, connection extra or input file
    RecordError,  # a record refused before sending (no key, too large, bad msg-id)
    AuthError,  # the server refused the credentials or the client certificate
    PermissionDenied,  # the connection's user lacks a permission the task needs
    StreamNotFoundError,  # the stream does not exist: provision it first
    StreamConflictError,  # partition count, prefix or storage differ from the stream's
    StrayMessagesError,  # messages on subjects no worker reads: waiting cannot drain them
    PartitionBlockedError,  # a poison message: the handler must be fixed first
    StreamRecreated,  # the group's positions refer to a deleted stream
    StateWentBack,  # the servers' stored state went back: an operator must decide
    GroupDeletedError,  # the group was deleted under the task
)


def unfixable(exc: BaseException) -> bool:
    """Whether ``exc`` is an error a retry of the task cannot fix (see :data:`UNFIXABLE`)."""
    return isinstance(exc, UNFIXABLE) and not isinstance(exc, AirflowException)


@contextmanager
def failing_at_once() -> Iterator[None]:
    """Re-raise an error of :data:`UNFIXABLE` as ``AirflowFailException`` with the same
    message (no retry is burned on it); every other exception passes through unchanged,
    so Airflow retries it as usual."""
    try:
        yield
    except Exception as exc:
        if unfixable(exc):
            raise AirflowFailException(str(exc)) from exc
        raise


__all__ = ["UNFIXABLE", "failing_at_once", "unfixable"]
