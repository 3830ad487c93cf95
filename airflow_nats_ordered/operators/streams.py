"""Provision a partitioned stream from a DAG (create, or verify and apply safe changes), and
repartition it (change its partition count, keeping every key's order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from airflow.sdk import BaseOperator

from airflow_nats_ordered.core.stream.partitioned import (
    DEFAULT_DUPLICATE_WINDOW,
    ProvisionResult,
    StreamSpec,
    describe,
    provision,
)
from airflow_nats_ordered.core.stream.repartition import interrupted, repartition
from airflow_nats_ordered.hooks.arguments import refuse_unknown_operator_arguments
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.failures import failing_at_once


class NatsProvisionStreamOperator(BaseOperator):
    """Create-or-verify a partitioned stream; idempotent, so it belongs at the top of a DAG.

    The arguments are the desired state: limits, duplicate window, replicas and description
    are applied in place when they differ; a different partition count, prefix or storage
    fails the task with what differs and what to do (they cannot change in place).

    ``duplicate_window`` must exceed the longest retry of anything publishing to the
    stream (Spark task retries, this DAG's task retries with their delays): inside it a
    retried publish stores nothing twice. Returns the stream's facts (XCom).
    """

    template_fields: Sequence[str] = ("stream", "subject_prefix", "description", "nats_conn_id")
    ui_color = "#b4e0c8"

    def __init__(
        self,
        *,
        stream: str,
        partitions: int,
        subject_prefix: str | None = None,
        replicas: int = 1,
        storage: Literal["file", "memory"] = "file",
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        max_age: float | None = None,
        max_bytes: int | None = None,
        max_msgs: int | None = None,
        max_msg_size: int | None = None,
        description: str | None = None,
        nats_conn_id: str = NatsHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(**kwargs)
        self.stream = stream
        self.partitions = partitions
        self.subject_prefix = subject_prefix
        self.replicas = replicas
        self.storage = storage
        self.duplicate_window = duplicate_window
        self.max_age = max_age
        self.max_bytes = max_bytes
        self.max_msgs = max_msgs
        self.max_msg_size = max_msg_size
        self.description = description
        self.nats_conn_id = nats_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        # a bad spec, a stream that cannot change in place: no retry fixes them
        with failing_at_once():
            return self._provision()

    def _provision(self) -> dict[str, Any]:
        spec = StreamSpec(
            name=self.stream,
            partitions=self.partitions,
            subject_prefix=self.subject_prefix,
            replicas=self.replicas,
            storage=self.storage,
            duplicate_window=self.duplicate_window,
            max_age=self.max_age,
            max_bytes=self.max_bytes,
            max_msgs=self.max_msgs,
            max_msg_size=self.max_msg_size,
            description=self.description,
        )

        async def run(nc: Any) -> ProvisionResult:
            return await provision(nc, spec)

        result = NatsHook(self.nats_conn_id).run(run)
        s = result.stream
        self.log.info(
            "stream %s %s (%d partitions, prefix %s, R%d)%s",
            s.name,
            result.action,
            s.partitions,
            s.prefix,
            s.replicas,
            f": {'; '.join(result.changes)}" if result.changes else "",
        )
        return {
            "stream": s.name,
            "action": result.action,
            "changes": list(result.changes),
            "partitions": s.partitions,
            "prefix": s.prefix,
            "replicas": s.replicas,
            "duplicate_window": s.duplicate_window,
            "created": s.created,
        }


class NatsRepartitionStreamOperator(BaseOperator):
    """Change a stream's partition count without breaking any key's order (the operator
    form of ``nats-ordered repartition``; see
    :func:`airflow_nats_ordered.core.stream.repartition.repartition`).

    Two stream updates: the first switches publishers to the new layout (the server refuses
    every publish still routed by the old one: a publish task that started before fails,
    and its retry reads the new layout, storing nothing twice) and marks the old layout's
    switch point pending; the second records it, exactly (the sequence of the old layout's
    last record). Each consumer group finishes every old partition before any record of the
    new layout is handed out, and moves on only once the switch point is recorded; drain
    sensors, ``status`` and lag say so meanwhile.

    Idempotent for Airflow retries: a try killed between the updates (or before) is
    completed by the next try (``action`` ``completed``); a stream that already has
    ``partitions`` partitions, its switch recorded, is left as it is (``action``
    ``unchanged``). An unknown stream or a count outside 1..4096
    fails the task at once; another repartition of the stream still running is retried.
    Returns the result (XCom): ``action``, ``stream``, ``previous_partitions``,
    ``partitions``, ``epoch``, ``switch_seq``, ``subjects``.
    """

    template_fields: Sequence[str] = ("stream", "nats_conn_id")
    ui_color = "#b4e0c8"

    def __init__(
        self,
        *,
        stream: str,
        partitions: int,
        nats_conn_id: str = NatsHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(**kwargs)
        self.stream = stream
        self.partitions = partitions
        self.nats_conn_id = nats_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        with failing_at_once():
            return NatsHook(self.nats_conn_id).run(self._repartition)

    async def _repartition(self, nc: Any) -> dict[str, Any]:
        # (read as it is: a repartition interrupted by a crash, or an earlier try of this
        # task killed, is completed by repartition() below, never reported as unchanged)
        current = await describe(nc, self.stream, check_layout=False)
        if (
            isinstance(self.partitions, int)
            and current.partitions == self.partitions
            and not interrupted(current)
        ):
            self.log.info(
                "stream %s already has %d partitions (epoch %d): nothing to do",
                self.stream,
                self.partitions,
                current.epoch,
            )
            return {
                "action": "unchanged",
                "stream": self.stream,
                "previous_partitions": self.partitions,
                "partitions": self.partitions,
                "epoch": current.epoch,
                "switch_seq": max((lay.switch_seq for lay in current.layouts), default=0),
                "subjects": current.subjects_text,
            }
        result = await repartition(nc, self.stream, self.partitions, progress=self.log.info)
        return result.to_json()  # action: repartitioned, or completed (an interrupted one)
