"""Wait until a worker pool has processed what a run published."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

from ..core.drain import read_lag
from ..core.runs import RunLedger
from ..hooks.nats import NatsHook
from ..triggers.drain import NatsGroupDrainTrigger


def resolve_marks(value: Any) -> dict[str, int] | None:
    """Marks from what a DAG author passes: a publish task's XCom (a run record with
    ``high_water_marks``), a ``{partition: seq}`` mapping, or "now"/None (-> None)."""
    if value is None or value == "now":
        return None
    if isinstance(value, Mapping) and "high_water_marks" in value:
        value = value["high_water_marks"]
    if not isinstance(value, Mapping):
        raise AirflowFailException(
            f"high_water_marks must be a publish task's result, a {{partition: sequence}} "
            f"mapping or 'now', got {type(value).__name__}"
        )
    try:
        return {str(int(p)): int(m) for p, m in value.items()}
    except (TypeError, ValueError):
        raise AirflowFailException(
            f"high_water_marks must map partition numbers to stream sequences, got {value!r}"
        ) from None


class NatsGroupDrainSensor(BaseSensorOperator):
    """Succeeds when group ``group`` has committed, on every partition, at least up to the
    marks: ``high_water_marks`` (the publish task's XCom, e.g. ``publish.output``, or a
    ``{partition: seq}`` mapping), or the run recorded under ``run`` (a producer id) in the
    stream's run ledger, or "now" (everything in the stream when the sensor starts).

    Deferrable by default: it checks once, then waits in the triggerer on the group's commit
    records (no worker slot held). It fails fast, saying what to do, when a partition is
    blocked on a poison message, when no member of the group has been alive for
    ``no_members_timeout`` seconds, when the stream was re-created, or at ``timeout``.
    """

    template_fields: Sequence[str] = ("stream", "group", "high_water_marks", "run")
    ui_color = "#f0e4c8"

    def __init__(
        self,
        *,
        stream: str,
        group: str,
        high_water_marks: Any = "now",
        run: str | None = None,
        no_members_timeout: float | None = 60.0,
        nats_conn_id: str = NatsHook.default_conn_name,
        deferrable: bool = True,
        poke_interval: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.stream = stream
        self.group = group
        self.high_water_marks = high_water_marks
        self.run = run
        self.no_members_timeout = no_members_timeout
        self.nats_conn_id = nats_conn_id
        self.deferrable = deferrable
        self._marks: dict[str, int] | None = None

    def _resolve(self, hook: NatsHook) -> dict[str, int]:
        if self._marks is not None:
            return self._marks
        marks = resolve_marks(self.high_water_marks) if self.run is None else None

        async def read(nc: Any) -> dict[str, int]:
            if self.run is not None:
                rec = await (await RunLedger.open(nc, self.stream, create=False)).get(self.run)
                if rec is None:
                    raise AirflowFailException(
                        f"run {self.run!r} is not in the run ledger of stream {self.stream}: "
                        "check the producer id (it is in the publish task's XCom)"
                    )
                return {str(p): m for p, m in rec.high_water_marks.items()}
            lag = await read_lag(nc, self.stream, self.group)
            return {str(p.partition): p.last for p in lag.partitions}

        self._marks = marks if marks is not None else hook.run(read)
        return self._marks

    def poke(self, context: Any) -> bool:
        hook = NatsHook(self.nats_conn_id)
        marks = self._resolve(hook)

        async def check(nc: Any) -> dict[int, tuple[int, int]]:
            lag = await read_lag(nc, self.stream, self.group)
            at = {p.partition: p for p in lag.partitions}
            behind = {}
            for p, m in marks.items():
                part = at.get(int(p))
                committed = part.committed if part else 0
                if committed < m:
                    if part is not None and part.blocked:
                        raise AirflowFailException(
                            f"partition {p} of stream {self.stream} is blocked in group "
                            f"{self.group}: {part.blocked}. Fix the handler and restart the "
                            "group's workers, or run them with the dead-letter policy"
                        )
                    behind[int(p)] = (committed, m)
            return behind

        behind = hook.run(check)
        if behind:
            self.log.info("group %s: %d partition(s) behind: %s", self.group, len(behind), behind)
        return not behind

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        started = time.time()
        if self.poke(context):
            self.log.info("group %s of %s has drained already", self.group, self.stream)
            return {"stream": self.stream, "group": self.group, "marks": self._marks, "waited": 0}
        timeout = (
            self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else self.timeout
        )
        self.defer(
            trigger=NatsGroupDrainTrigger(
                stream=self.stream,
                group=self.group,
                marks=self._marks or {},
                nats_conn_id=self.nats_conn_id,
                timeout=timeout,
                started=started,
                no_members_timeout=self.no_members_timeout,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") == "success":
            self.log.info(
                "group %s of %s drained in %ss", self.group, self.stream, event.get("waited")
            )
            return event
        reason, message = event.get("reason"), event.get("message", "unknown error")
        if reason == "timeout":
            raise AirflowSensorTimeout(message)
        if reason == "no_members":
            raise AirflowException(message)  # retries may help once workers are back
        raise AirflowFailException(message)
