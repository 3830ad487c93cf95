"""Wait in the triggerer until a consumer group has processed what a run published."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_nats_ordered.core.admin.drain import DEFAULT_NO_MEMBERS_TIMEOUT, wait_drained
from airflow_nats_ordered.core.admin.drain_errors import (
    DrainTimeoutError,
    NoMembersError,
    PartitionBlockedError,
)
from airflow_nats_ordered.core.admin.marks import DrainProgress
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.hooks.arguments import refuse_unknown_arguments
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.failures import unfixable

#: how often progress (lag per partition still behind) is logged while waiting
LOG_EVERY = 30.0


class NatsGroupDrainTrigger(BaseTrigger):
    """Fires once every partition's committed position reached its mark.

    It watches the group's commit records (pushed by the server, not polled), so success is
    seen within a commit of the last message. The event is ``{"status": "success", ...}``
    or ``{"status": "error", "reason": "blocked" | "no_members" | "timeout" | "error",
    "message": ...}`` (with ``"retryable"`` for ``"error"``: whether a retry may get through,
    e.g. a server that did not answer); the sensor turns an error into a task failure with
    the message, retried only where a retry may help.

    ``marks``: partition (as text, JSON keys) -> stream sequence; concrete, never "now":
    the marks the sensor's try resolved at its first poke, before deferring, so neither a
    triggerer restart nor messages published while it waits move them.
    ``timeout``: seconds from ``started`` (epoch), so a restarted trigger keeps the deadline.
    ``no_members_timeout``: fail when no member of the group has been alive this long, or
    the group still has no state (no worker joined it) after that long (default
    :data:`~airflow_nats_ordered.core.admin.drain.DEFAULT_NO_MEMBERS_TIMEOUT`; None waits anyway).
    A group with no
    state yet is waited for, not failed: its workers may be starting.
    """

    def __init__(
        self,
        *,
        stream: str,
        group: str,
        marks: dict[str, int],
        nats_conn_id: str = NatsHook.default_conn_name,
        timeout: float | None = None,
        started: float | None = None,
        no_members_timeout: float | None = DEFAULT_NO_MEMBERS_TIMEOUT,
        **unknown: Any,
    ) -> None:
        # a misspelt argument (no_member_timeout=) fails naming the one meant
        refuse_unknown_arguments("NatsGroupDrainTrigger", unknown, NatsGroupDrainTrigger.__init__)
        super().__init__()
        self.stream = stream
        self.group = group
        self.marks = {str(p): int(m) for p, m in marks.items()}
        self.nats_conn_id = nats_conn_id
        self.timeout = timeout
        self.started = started if started is not None else time.time()
        self.no_members_timeout = no_members_timeout

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "stream": self.stream,
                "group": self.group,
                "marks": self.marks,
                "nats_conn_id": self.nats_conn_id,
                "timeout": self.timeout,
                "started": self.started,
                "no_members_timeout": self.no_members_timeout,
            },
        )

    def _log_progress(self, progress: DrainProgress) -> None:
        now = time.monotonic()
        if now - getattr(self, "_logged", 0.0) < LOG_EVERY and not progress.done:
            return
        self._logged = now
        if progress.group_missing and not progress.done:
            self.log.info(
                "group %s of %s has no state yet (no worker has joined it): waiting for it",
                self.group,
                self.stream,
            )
            return
        if progress.pending_switch is not None and not progress.done:
            self.log.info(
                "group %s of %s: the stream's repartition has not recorded the switch point "
                "of layout epoch %d yet (running, or interrupted: `nats-ordered repartition "
                "--stream %s --partitions N` with its count completes it); the marks are "
                "compared once it has",
                self.group,
                self.stream,
                progress.pending_switch,
                self.stream,
            )
            return
        behind = progress.behind
        if not behind:
            self.log.info(
                "group %s of %s: every partition reached its mark", self.group, self.stream
            )
            return
        shown = ", ".join(f"p{p} {c}/{m}" for p, (c, m) in list(behind.items())[:16])
        self.log.info(
            "group %s of %s: %d partition(s) behind (committed/mark): %s%s",
            self.group,
            self.stream,
            len(behind),
            shown,
            " ..." if len(behind) > 16 else "",
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        remaining = None
        if self.timeout is not None:
            remaining = max(0.0, self.timeout - (time.time() - self.started))
        base: dict[str, Any] = {"stream": self.stream, "group": self.group}
        try:
            async with NatsHook(self.nats_conn_id).aconnect() as nc:
                progress = await wait_drained(
                    nc,
                    self.stream,
                    self.group,
                    marks={int(p): m for p, m in self.marks.items()},
                    timeout=remaining,
                    no_members_timeout=self.no_members_timeout,
                    on_progress=self._log_progress,
                )
        except PartitionBlockedError as exc:
            event = {**base, "status": "error", "reason": "blocked", "message": str(exc)}
        except NoMembersError as exc:
            event = {**base, "status": "error", "reason": "no_members", "message": str(exc)}
        except DrainTimeoutError as exc:
            event = {**base, "status": "error", "reason": "timeout", "message": str(exc)}
        except NatsOrderedError as exc:
            # "retryable": whether a retry of the task may get through (a server that did
            # not answer) or would meet the same error (a missing stream, strays, ...)
            event = {
                **base,
                "status": "error",
                "reason": "error",
                "message": str(exc),
                "retryable": not unfixable(exc),
            }
        else:
            event = {
                **base,
                "status": "success",
                "marks": self.marks,
                "waited": round(progress.elapsed, 3),
                "since_start": round(time.time() - self.started, 3),
            }
        yield TriggerEvent(event)
