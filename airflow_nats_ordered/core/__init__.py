"""Asyncio core over nats-py: partitioning, provisioning, publishing, leases, workers.

Nothing here imports Airflow or Spark, so the core runs on a Spark executor or in a plain
worker container.

The names a program needs are importable from here (``from airflow_nats_ordered.core import
OrderedPublisher, StreamSpec, provision, Worker, WorkerConfig``): this package and these
names are the core's public API, stable across releases; the wings' modules
(``core.publish.publisher``, ...) are its inside and may move. Each name is loaded on first
use (PEP 562), so importing this package imports none of the wings: a program that only
publishes does not load the group, worker and order code. ``_EXPORTS`` names the module each
name lives in; type checkers read the same names from the ``TYPE_CHECKING`` imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_nats_ordered.core.admin.dead_letters import (
        DeadLetter,
        DeadLetterNotFoundError,
        purge_dead_letters,
        read_dead_letters,
        replay_dead_letters,
    )
    from airflow_nats_ordered.core.admin.delete import GroupInUseError, delete_group
    from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
    from airflow_nats_ordered.core.admin.drain_errors import (
        DrainTimeoutError,
        NoGroupStateError,
        NoMembersError,
        PartitionBlockedError,
        RepartitionUnfinishedError,
        StrayMessagesError,
    )
    from airflow_nats_ordered.core.admin.listing import GroupSummary, find_groups, summarize_group
    from airflow_nats_ordered.core.admin.membership import GroupNotFoundError, live_members
    from airflow_nats_ordered.core.admin.permissions import ROLES, RolePermissions, permissions_for
    from airflow_nats_ordered.core.admin.rebalance import rebalance_group
    from airflow_nats_ordered.core.admin.reset import reset_group
    from airflow_nats_ordered.core.connection.connect import connect
    from airflow_nats_ordered.core.connection.options import ConnectionOptions
    from airflow_nats_ordered.core.errors import (
        AuthError,
        BatchFailed,
        ConfigError,
        ConnectError,
        InvalidKeyError,
        InvalidMsgIdError,
        KeyEncodingError,
        KeylessRecordError,
        KeyTextError,
        MissingKeyError,
        NatsOrderedError,
        OrderConflict,
        PartitionMismatchError,
        PermissionDenied,
        RecordError,
        RecordTooLargeError,
        StreamConflictError,
        StreamNotFoundError,
    )
    from airflow_nats_ordered.core.group.commits import Fenced
    from airflow_nats_ordered.core.group.lag import GroupLag, PartitionLag
    from airflow_nats_ordered.core.order.reader import (
        GlobalHandler,
        GlobalMessage,
        GlobalOrderReader,
    )
    from airflow_nats_ordered.core.order.watermarks import GlobalOrder
    from airflow_nats_ordered.core.order.window import LateRecordError
    from airflow_nats_ordered.core.publish.config import PublisherConfig
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
    from airflow_nats_ordered.core.publish.runs import (
        RunLedger,
        RunRecord,
        RunResult,
        SourceRecord,
        publish_run,
    )
    from airflow_nats_ordered.core.publish.summary import (
        PartitionSummary,
        PublishError,
        PublishSummary,
    )
    from airflow_nats_ordered.core.sink.errors import SinkBusyError, SinkOrderError, SinkUsageError
    from airflow_nats_ordered.core.sink.fenced import ApplyFn, BatchItem, FencedSqliteSink
    from airflow_nats_ordered.core.sink.fencing import Verdict
    from airflow_nats_ordered.core.stream.keys import message_key
    from airflow_nats_ordered.core.stream.message import BatchHandler, Handler, Message
    from airflow_nats_ordered.core.stream.partitioned import (
        LayoutMismatchError,
        PartitionedStream,
        ProvisionResult,
        StreamSpec,
        describe,
        provision,
        purge_strays,
        stray_messages,
    )
    from airflow_nats_ordered.core.stream.partitioning import partition_for, partition_subject
    from airflow_nats_ordered.core.stream.repartition import (
        RepartitionResult,
        RepartitionRunning,
        repartition,
    )
    from airflow_nats_ordered.core.stream.strays import Strays
    from airflow_nats_ordered.core.worker.config import WorkerConfig
    from airflow_nats_ordered.core.worker.pool import WorkerPool
    from airflow_nats_ordered.core.worker.presence import GroupDeletedError
    from airflow_nats_ordered.core.worker.worker import Worker, run_worker

#: module -> the public names defined there (tests/core/test_public_api.py checks that each is
#: defined in its module, not imported into it, and that this table, ``__all__`` and the
#: ``TYPE_CHECKING`` imports above list the same names)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "airflow_nats_ordered.core.errors": (
        "NatsOrderedError",
        "ConfigError",
        "ConnectError",
        "AuthError",
        "StreamNotFoundError",
        "StreamConflictError",
        "PartitionMismatchError",
        "RecordError",
        "MissingKeyError",
        "RecordTooLargeError",
        "InvalidKeyError",
        "KeyTextError",
        "KeyEncodingError",
        "InvalidMsgIdError",
        "KeylessRecordError",
        "BatchFailed",
        "OrderConflict",
        "PermissionDenied",
    ),
    "airflow_nats_ordered.core.connection.options": ("ConnectionOptions",),
    "airflow_nats_ordered.core.connection.connect": ("connect",),
    "airflow_nats_ordered.core.stream.partitioned": (
        "StreamSpec",
        "PartitionedStream",
        "ProvisionResult",
        "LayoutMismatchError",
        "provision",
        "describe",
        "stray_messages",
        "purge_strays",
    ),
    "airflow_nats_ordered.core.stream.partitioning": (
        "partition_for",
        "partition_subject",
    ),
    "airflow_nats_ordered.core.stream.keys": ("message_key",),
    "airflow_nats_ordered.core.stream.message": (
        "Message",
        "Handler",
        "BatchHandler",
    ),
    "airflow_nats_ordered.core.stream.repartition": (
        "repartition",
        "RepartitionResult",
        "RepartitionRunning",
    ),
    "airflow_nats_ordered.core.stream.strays": ("Strays",),
    "airflow_nats_ordered.core.publish.publisher": ("OrderedPublisher",),
    "airflow_nats_ordered.core.publish.config": ("PublisherConfig",),
    "airflow_nats_ordered.core.publish.summary": (
        "PublishSummary",
        "PartitionSummary",
        "PublishError",
    ),
    "airflow_nats_ordered.core.publish.runs": (
        "publish_run",
        "SourceRecord",
        "RunLedger",
        "RunRecord",
        "RunResult",
    ),
    "airflow_nats_ordered.core.group.commits": ("Fenced",),
    "airflow_nats_ordered.core.group.lag": (
        "GroupLag",
        "PartitionLag",
    ),
    "airflow_nats_ordered.core.worker.worker": (
        "Worker",
        "run_worker",
    ),
    "airflow_nats_ordered.core.worker.config": ("WorkerConfig",),
    "airflow_nats_ordered.core.worker.pool": ("WorkerPool",),
    "airflow_nats_ordered.core.worker.presence": ("GroupDeletedError",),
    "airflow_nats_ordered.core.order.reader": (
        "GlobalOrderReader",
        "GlobalMessage",
        "GlobalHandler",
    ),
    "airflow_nats_ordered.core.order.window": ("LateRecordError",),
    "airflow_nats_ordered.core.sink.fenced": (
        "FencedSqliteSink",
        "ApplyFn",
        "BatchItem",
    ),
    "airflow_nats_ordered.core.sink.fencing": ("Verdict",),
    "airflow_nats_ordered.core.sink.errors": (
        "SinkBusyError",
        "SinkUsageError",
        "SinkOrderError",
    ),
    "airflow_nats_ordered.core.admin.drain": (
        "wait_drained",
        "read_lag",
    ),
    "airflow_nats_ordered.core.admin.listing": (
        "find_groups",
        "summarize_group",
        "GroupSummary",
    ),
    "airflow_nats_ordered.core.admin.dead_letters": (
        "read_dead_letters",
        "replay_dead_letters",
        "purge_dead_letters",
        "DeadLetter",
        "DeadLetterNotFoundError",
    ),
    "airflow_nats_ordered.core.admin.delete": (
        "GroupInUseError",
        "delete_group",
    ),
    "airflow_nats_ordered.core.admin.drain_errors": (
        "DrainTimeoutError",
        "NoGroupStateError",
        "NoMembersError",
        "PartitionBlockedError",
        "RepartitionUnfinishedError",
        "StrayMessagesError",
    ),
    "airflow_nats_ordered.core.admin.membership": (
        "GroupNotFoundError",
        "live_members",
    ),
    "airflow_nats_ordered.core.admin.permissions": ("ROLES", "RolePermissions", "permissions_for"),
    "airflow_nats_ordered.core.admin.rebalance": ("rebalance_group",),
    "airflow_nats_ordered.core.admin.reset": ("reset_group",),
    "airflow_nats_ordered.core.order.watermarks": ("GlobalOrder",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "ApplyFn",
    "AuthError",
    "BatchFailed",
    "BatchHandler",
    "BatchItem",
    "ConfigError",
    "ConnectError",
    "ConnectionOptions",
    "DeadLetter",
    "DeadLetterNotFoundError",
    "DrainTimeoutError",
    "Fenced",
    "FencedSqliteSink",
    "GlobalHandler",
    "GlobalMessage",
    "GlobalOrder",
    "GlobalOrderReader",
    "GroupDeletedError",
    "GroupInUseError",
    "GroupLag",
    "GroupNotFoundError",
    "GroupSummary",
    "Handler",
    "InvalidKeyError",
    "InvalidMsgIdError",
    "KeyEncodingError",
    "KeyTextError",
    "KeylessRecordError",
    "LateRecordError",
    "LayoutMismatchError",
    "Message",
    "MissingKeyError",
    "NatsOrderedError",
    "NoGroupStateError",
    "NoMembersError",
    "OrderConflict",
    "OrderedPublisher",
    "PartitionBlockedError",
    "PartitionLag",
    "PartitionMismatchError",
    "PartitionSummary",
    "PartitionedStream",
    "PermissionDenied",
    "ProvisionResult",
    "PublishError",
    "PublishSummary",
    "PublisherConfig",
    "ROLES",
    "RecordError",
    "RecordTooLargeError",
    "RepartitionResult",
    "RepartitionRunning",
    "RepartitionUnfinishedError",
    "RolePermissions",
    "RunLedger",
    "RunRecord",
    "RunResult",
    "SinkBusyError",
    "SinkOrderError",
    "SinkUsageError",
    "SourceRecord",
    "StrayMessagesError",
    "Strays",
    "StreamConflictError",
    "StreamNotFoundError",
    "StreamSpec",
    "Verdict",
    "Worker",
    "WorkerConfig",
    "WorkerPool",
    "connect",
    "delete_group",
    "describe",
    "find_groups",
    "live_members",
    "message_key",
    "partition_for",
    "partition_subject",
    "permissions_for",
    "provision",
    "publish_run",
    "purge_dead_letters",
    "purge_strays",
    "read_dead_letters",
    "read_lag",
    "rebalance_group",
    "repartition",
    "replay_dead_letters",
    "reset_group",
    "run_worker",
    "stray_messages",
    "summarize_group",
    "wait_drained",
]


def _load(name: str) -> object:
    """The public ``name``, imported from its module on first use, then kept here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# under TYPE_CHECKING the names come from the imports above: without a module __getattr__
# there, a checker still reports a name this package does not export
if not TYPE_CHECKING:
    __getattr__ = _load
