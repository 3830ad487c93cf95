"""Wait until a worker pool has processed what a run published."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

from airflow_nats_ordered.core.admin.drain import DEFAULT_NO_MEMBERS_TIMEOUT, read_lag
from airflow_nats_ordered.core.admin.drain_errors import no_members_error
from airflow_nats_ordered.core.admin.marks import marks_to_wait
from airflow_nats_ordered.core.admin.membership import group_exists, live_members
from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.core.stream.layout import pending_switch_problem
from airflow_nats_ordered.core.stream.partitioned import describe, stream_contents
from airflow_nats_ordered.hooks.arguments import refuse_unknown_operator_arguments
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.failures import failing_at_once
from airflow_nats_ordered.triggers.drain import NatsGroupDrainTrigger

#: task state store key under which a try keeps the marks it resolved at its first poke
MARKS_KEY = "nats_ordered_drain_marks"

#: task state store key under which a rescheduled try keeps when it last saw a live member
MEMBERS_KEY = "nats_ordered_drain_members_seen"

#: a kept record outlives the sensor's ``timeout`` by this much (task state store retention)
KEEP_MARGIN = timedelta(days=1)


def default_deferrable() -> bool:
    """The drain sensor's ``deferrable`` when the DAG does not pass it: Airflow's
    ``[operators] default_deferrable`` (false unless the deployment sets it true), as every
    Airflow provider's deferrable operator and sensor reads it. Read when the sensor is
    created (when the DAG is parsed)."""
    return conf.getboolean("operators", "default_deferrable", fallback=False)


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


@dataclass(frozen=True)
class TryMarks:
    """The marks one try of the sensor resolved from NATS at its first poke, kept in the
    try's Airflow task state store so every later poke of the same try uses them.

    Why the task state store (Airflow 3.3, ``context["task_state_store"]``), checked in
    Airflow 3.3's own code:

    * ``self`` does not survive a reschedule: every poke in ``mode="reschedule"`` is a new
      task process running a fresh copy of the operator.
    * XCom does not survive either: the execution API's ``ti_run`` hands the worker every
      XCom key of the task instance to delete whenever it starts running other than a
      resume from deferral (``xcom_keys_to_clear``), so a reschedule wipes what an earlier
      poke pushed.
    * "marks as of the first poke's time" is not exact: ``ti.get_first_reschedule_date()``
      is the start of the try's first task run (the first ``task_reschedule`` row), on the
      Airflow worker's clock, not the moment the poke read the stream, while a message's
      time is set by the NATS server's clock; no reading by time can promise to leave out
      every record stored after the first poke read the stream.
    * the task state store lives in the metadata DB (or the configured state backend),
      scoped to dag/run/task/map index, is not cleared by reschedules, retries or clears,
      and survives any process restart. It is not scoped to a try, so the record carries
      the task instance id: Airflow gives a task instance a new id for each try (a retry or
      a clear runs ``prepare_db_for_next_try``) and keeps it across the reschedules of one
      try. A record of another id is another try's and is never used.

    Guarantees: the marks come from one read of the stream at the try's first poke, so
    they never include a record stored after that read; every later poke of the try (same
    process or not) waits for exactly those marks; a new try (retry, clear, a new DAG run)
    resolves fresh ones. The record is written before the first poke checks the group, so
    a try that was rescheduled always has one; it is kept past the sensor's ``timeout``
    (see :meth:`NatsGroupDrainSensor._keep_for`), whatever ``[state_store]
    default_retention_days`` says. If it is gone anyway (deleted through the API) the poke
    fails instead of quietly taking newer marks.
    """

    store: Any  # TaskStateStoreAccessor
    ti_id: str
    try_number: int
    rescheduled: bool  # an earlier poke of this try ended in a reschedule

    @classmethod
    def of(cls, context: Mapping[str, Any]) -> TryMarks | None:
        """The running try's keeper, or None outside a task run (no task state store)."""
        store, ti = context.get("task_state_store"), context.get("ti")
        if store is None or ti is None or getattr(ti, "id", None) is None:
            return None
        return cls(
            store,
            str(ti.id),
            int(ti.try_number),
            int(context.get("task_reschedule_count") or 0) > 0,
        )

    def load(self) -> dict[str, Any] | None:
        """This try's record, or None if the store holds none for this try."""
        rec = self.store.get(MARKS_KEY)
        if isinstance(rec, Mapping) and rec.get("ti_id") == self.ti_id:
            return dict(rec)
        return None

    def save(self, rec: dict[str, Any], keep: timedelta | None) -> None:
        self.store.set(
            MARKS_KEY,
            {"ti_id": self.ti_id, "try_number": self.try_number, **rec},
            retention=keep,
        )


class NatsGroupDrainSensor(BaseSensorOperator):
    """Succeeds when group ``group`` has committed, on every partition, at least up to the
    marks: ``high_water_marks`` (the publish task's XCom, e.g. ``publish.output``, or a
    ``{partition: seq}`` mapping), or the run recorded under ``run`` (a producer id) in the
    stream's run ledger, or "now" (every partition's last sequence at the try's first poke).

    Marks read from NATS ("now", ``run``) are resolved once per try and kept for the whole
    try in every mode: in poke mode on the operator, in reschedule mode in the try's task
    state store (see :class:`TryMarks`), in deferrable mode in the trigger's arguments. A
    later poke never moves them, so messages published while the sensor waits are not
    waited for; a new try (retry, clear) resolves fresh marks. The XCom in every mode is
    ``{"stream", "group", "marks", "waited"}``.

    A group that has no state yet (no worker has joined it: the workers are being started
    beside the DAG) is waited for like a group that has committed nothing, not failed.

    Deferrable (``deferrable=True``, or ``[operators] default_deferrable = true`` in the
    deployment when the DAG does not pass it, as for every Airflow deferrable operator): it
    checks once, then waits in the triggerer on the group's commit records (no worker slot
    held). It defers with what is left of ``timeout``, so the scheduler fails the task at
    the deadline even while no triggerer runs. Not deferred, it pokes every
    ``poke_interval`` seconds: BaseSensorOperator's default, 60. It fails
    fast, saying what to do, when a partition is blocked on a poison message, when no
    member of the group has been alive (or, for a group with no state yet, none has
    joined) for ``no_members_timeout`` seconds (default
    :data:`~airflow_nats_ordered.core.admin.drain.DEFAULT_NO_MEMBERS_TIMEOUT`, 60; None waits
    anyway), when the
    stream was re-created, or at ``timeout``.
    """

    template_fields: Sequence[str] = ("stream", "group", "high_water_marks", "run", "nats_conn_id")
    template_fields_renderers = {"high_water_marks": "json"}
    ui_color = "#f0e4c8"

    def __init__(
        self,
        *,
        stream: str,
        group: str,
        high_water_marks: Any = "now",
        run: str | None = None,
        no_members_timeout: float | None = DEFAULT_NO_MEMBERS_TIMEOUT,
        nats_conn_id: str = NatsHook.default_conn_name,
        deferrable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        # poke_interval, timeout, mode: BaseSensorOperator's, with its defaults (60 s
        # between pokes; a shorter one in reschedule mode raced the executor)
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(**kwargs)
        self.stream = stream
        self.group = group
        self.high_water_marks = high_water_marks
        self.run = run
        self.no_members_timeout = no_members_timeout
        self.nats_conn_id = nats_conn_id
        # None: the deployment's [operators] default_deferrable (Airflow's convention)
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self._marks: dict[str, int] | None = None
        self._marks_try: str | None = None  # the task instance id (try) they belong to
        self._resolved_at: float | None = None
        self._members_seen: float | None = None  # this try's last sight of a live member
        self._members_try: str | None = None

    def _timeout_seconds(self) -> float:
        t = self.timeout
        return t.total_seconds() if isinstance(t, timedelta) else float(t)

    def _defer_timeout(self, started: float) -> timedelta | None:
        """What is left of ``timeout`` for a try that started (epoch) at ``started``: given
        to ``defer()`` as Airflow's deferrable sensors do, so the task instance's
        ``trigger_timeout`` holds the deadline and the scheduler fails the task at it even
        while no triggerer runs (``AirflowSensorTimeout``). None (no deadline) for a
        timeout of more than ten years, which the stored date could not hold."""
        seconds = self._timeout_seconds()
        if seconds > 3650 * 86400:
            return None
        return timedelta(seconds=max(0.0, seconds - (time.time() - started)))

    def _keep_for(self) -> timedelta | None:
        """How long the task state store keeps a try's marks: past the sensor's timeout
        (whatever ``[state_store] default_retention_days`` says), None = never expire."""
        from airflow.sdk.execution_time.context import NEVER_EXPIRE

        seconds = self._timeout_seconds()
        if seconds > 3650 * 86400:  # no real deadline: keep them as long as the try runs
            return NEVER_EXPIRE
        return timedelta(seconds=seconds) + KEEP_MARGIN

    def _source(self) -> str:
        return f"run {self.run}" if self.run is not None else "now"

    def _resolve(self, hook: NatsHook, context: Mapping[str, Any]) -> dict[str, int]:
        keeper = TryMarks.of(context)
        this_try = keeper.ti_id if keeper is not None else None
        if self._marks is not None and self._marks_try == this_try:
            return self._marks
        self._marks_try = this_try
        if self.run is None:
            given = resolve_marks(self.high_water_marks)
            if given is not None:
                self._marks, self._resolved_at = given, time.time()
                return given
        if keeper is not None:
            kept = keeper.load()
            if kept is not None:
                self._check_kept(kept)
                self._marks = {str(p): int(m) for p, m in kept["marks"].items()}
                self._resolved_at = float(kept.get("resolved_at") or time.time())
                self.log.info(
                    "waiting for the marks try %d resolved at its first poke (%s): %s",
                    keeper.try_number,
                    self._source(),
                    self._marks,
                )
                return self._marks
            if keeper.rescheduled:
                raise AirflowException(
                    f"the marks try {keeper.try_number} of this sensor resolved at its first "
                    f"poke are gone from its task state store (key {MARKS_KEY!r}: deleted through "
                    "the API or a state store cleanup); resolving them "
                    "again would also wait for messages published since. A retry or a clear "
                    "of the task starts a new try, which resolves fresh marks"
                )
        marks = hook.run(self._read_marks)
        resolved_at = time.time()
        if keeper is not None:
            keeper.save(
                {
                    "stream": self.stream,
                    "group": self.group,
                    "source": self._source(),
                    "marks": marks,
                    "resolved_at": resolved_at,
                },
                self._keep_for(),
            )
        self.log.info(
            "marks for group %s of %s (%s), resolved at the first poke of this try and kept "
            "until it ends: %s",
            self.group,
            self.stream,
            self._source(),
            marks,
        )
        self._marks, self._resolved_at = marks, resolved_at
        return marks

    def _check_kept(self, kept: Mapping[str, Any]) -> None:
        was = (kept.get("stream"), kept.get("group"), kept.get("source"))
        now = (self.stream, self.group, self._source())
        if was != now:
            raise AirflowFailException(
                f"this try resolved its marks for stream {was[0]}, group {was[1]} ({was[2]}) "
                f"but the sensor now names stream {now[0]}, group {now[1]} ({now[2]}): the "
                "DAG changed during the try. Clear the task so a new try resolves marks for "
                "the new settings"
            )

    async def _read_marks(self, nc: Any) -> dict[str, int]:
        if self.run is not None:
            rec = await (await RunLedger.open(nc, self.stream, create=False)).get(self.run)
            if rec is None:
                raise AirflowFailException(
                    f"run {self.run!r} is not in the run ledger of stream {self.stream}: "
                    "check the producer id (it is in the publish task's XCom)"
                )
            return {str(p): m for p, m in rec.high_water_marks.items()}
        # the stream's last sequences: the group need not have state yet
        contents = await stream_contents(nc, await describe(nc, self.stream))
        return {str(s.partition): s.last_seq for s in contents.partitions}

    def _result(self) -> dict[str, Any]:
        waited = 0.0 if self._resolved_at is None else max(0.0, time.time() - self._resolved_at)
        return {
            "stream": self.stream,
            "group": self.group,
            "marks": self._marks,
            "waited": round(waited, 3),
        }

    def poke(self, context: Any) -> bool | PokeReturnValue:
        """False while a partition is behind its mark; once none is, True carrying the
        XCom (``stream``, ``group``, ``marks``, ``waited``). What no retry can fix (a
        missing stream or run, a blocked partition, strays, bad arguments) raises
        ``AirflowFailException``; a server that does not answer raises what a retry may fix."""
        with failing_at_once():
            return self._poke(context)

    def _poke(self, context: Any) -> bool | PokeReturnValue:
        hook = NatsHook(self.nats_conn_id)
        marks = self._resolve(hook, context or {})

        waiting: list[str] = []  # why the group cannot be drained whatever the marks say

        async def check(nc: Any) -> dict[int, tuple[int, int]]:
            if not await group_exists(nc, self.stream, self.group):
                # no worker has joined yet (they may be starting): nothing is committed
                contents = await stream_contents(nc, await describe(nc, self.stream))
                if contents.strays:
                    raise AirflowFailException(contents.strays.problem())
                behind = {int(p): (0, m) for p, m in marks.items() if m > 0}
                if behind:
                    self.log.info(
                        "group %s of %s has no state yet (no worker has joined it): waiting "
                        "for its workers",
                        self.group,
                        self.stream,
                    )
                return behind
            lag = await read_lag(nc, self.stream, self.group)
            if lag.strays:  # no worker reads them: waiting cannot drain them
                raise AirflowFailException(lag.strays.problem())
            if lag.switch_unfinished:
                # the closed layout may still receive records, and the group stays on it:
                # not drained, whatever the marks (a run's marks may be of either layout)
                described = await describe(nc, self.stream)
                waiting.append(
                    pending_switch_problem(
                        self.stream,
                        described.current_partitions,
                        described.current_epoch,
                        lag.pending_switch if lag.pending_switch is not None else lag.epoch,
                    )
                )
                return {int(p): (0, m) for p, m in marks.items() if m > 0}
            if lag.epoch != lag.stream_epoch:
                waiting.append(f"group still on layout epoch {lag.epoch}")
                self.log.info(
                    "group %s of %s is still applying layout epoch %d (the stream is at "
                    "epoch %d): it moves once every earlier partition is applied",
                    self.group,
                    self.stream,
                    lag.epoch,
                    lag.stream_epoch,
                )
                return {int(p): (0, m) for p, m in marks.items() if m > 0}
            # the lag is of the stream's layout now; marks of an earlier one are met
            pending = marks_to_wait(
                marks,
                partitions=len(lag.partitions),
                switch_seq=lag.switch_seq,
                stream=self.stream,
            )
            at = {p.partition: p for p in lag.partitions}
            behind = {}
            for p, m in pending.items():
                part = at.get(p)
                committed = part.committed if part else 0
                if committed < m:
                    if part is not None and part.blocked:
                        raise AirflowFailException(
                            f"partition {p} of stream {self.stream} is blocked in group "
                            f"{self.group}: {part.blocked}. Fix the handler and restart the "
                            "group's workers, or run them with the dead-letter policy"
                        )
                    behind[p] = (committed, m)
            return behind

        behind = hook.run(check)
        if waiting:
            self.log.info("group %s of %s is not drained: %s", self.group, self.stream, waiting[0])
        if behind or waiting:
            self.log.info("group %s: %d partition(s) behind: %s", self.group, len(behind), behind)
            self._check_members(hook, context or {}, behind)
            return False
        return PokeReturnValue(True, self._result())

    def _check_members(
        self,
        hook: NatsHook,
        context: Mapping[str, Any],
        behind: Mapping[int, tuple[int, int]],
    ) -> None:
        """The trigger's no-members rule, for ``deferrable=False``: fail (retryably) when no
        member of the group has been alive for ``no_members_timeout`` seconds of this try's
        wait, counted from its first poke. In reschedule mode (a new process each poke)
        the last sight of a member is kept in the try's task state store."""
        if self.no_members_timeout is None:
            return
        now = time.time()
        keeper = TryMarks.of(context) if self.mode == "reschedule" else None
        this_try = keeper.ti_id if keeper is not None else None
        if self._members_seen is None or self._members_try != this_try:
            self._members_try, self._members_seen = this_try, now
            if keeper is not None:
                kept = keeper.store.get(MEMBERS_KEY)
                if isinstance(kept, Mapping) and kept.get("ti_id") == this_try:
                    self._members_seen = float(kept.get("at") or now)
                else:
                    self._save_members_seen(keeper, now)

        async def members(nc: Any) -> tuple[bool, list[str]]:
            if not await group_exists(nc, self.stream, self.group):
                return False, []
            return True, await live_members(nc, self.stream, self.group)

        exists, alive = hook.run(members)
        if alive:
            self._members_seen = now
            if keeper is not None:
                self._save_members_seen(keeper, now)
            return
        if now - self._members_seen > self.no_members_timeout:
            # the partitions this poke found behind (and logged), not every mark
            raise AirflowException(
                str(
                    no_members_error(
                        self.stream,
                        self.group,
                        self.no_members_timeout,
                        behind,
                        group_missing=not exists,
                    )
                )
            )

    def _save_members_seen(self, keeper: TryMarks, at: float) -> None:
        keeper.store.set(MEMBERS_KEY, {"ti_id": keeper.ti_id, "at": at}, retention=self._keep_for())

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        started = time.time()
        done = self.poke(context)
        if done:
            self.log.info("group %s of %s has drained already", self.group, self.stream)
            return done.xcom_value if isinstance(done, PokeReturnValue) else self._result()
        self.defer(
            trigger=NatsGroupDrainTrigger(
                stream=self.stream,
                group=self.group,
                marks=self._marks or {},
                nats_conn_id=self.nats_conn_id,
                timeout=self._timeout_seconds(),
                started=started,
                no_members_timeout=self.no_members_timeout,
            ),
            method_name="execute_complete",
            timeout=self._defer_timeout(started),
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
        if reason == "no_members" or event.get("retryable"):
            # retries may help: workers coming back, a server that answers again
            raise AirflowException(message)
        raise AirflowFailException(message)
