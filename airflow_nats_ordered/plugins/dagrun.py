"""What a DAG run's drain sensors wait on, read from Airflow's metadata DB (the api-server's
own session), for the view's DAG run panel (``GET /nats-ordered/api/dagrun``).

Per :class:`~airflow_nats_ordered.sensors.drain.NatsGroupDrainSensor` task instance of the
run (``task_instance.operator`` is its class name): its state, the stream and group (its
rendered template fields; before the task first ran, the serialized DAG's unrendered
values), and the marks it waits for, from where the sensor keeps them:

* ``xcom``: a finished sensor's ``return_value`` (``{"stream", "group", "marks", "waited"}``);
* ``trigger``: a deferred sensor's trigger arguments (the ``trigger`` table, decrypted by
  Airflow's Trigger model; only ``marks``, ``stream``, ``group`` and ``nats_conn_id`` are
  taken, nothing else of them is returned);
* ``task_state_store``: the record the running try resolved at its first poke (key
  :data:`~airflow_nats_ordered.sensors.drain.MARKS_KEY`, used only if it is this try's:
  its ``ti_id`` is the task instance's id);
* ``high_water_marks``: marks the DAG passed as a ``{partition: seq}`` mapping (or a
  publish task's result), rendered.

None of them is a secret: the connection's fields are never read here. The NATS side (each
mark's committed position and exact lag) is
:func:`~airflow_nats_ordered.core.admin.overview.drain_wait_status`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: the class name Airflow stores in ``task_instance.operator`` for the drain sensor
SENSOR = "NatsGroupDrainSensor"
#: the task state store key the sensor keeps a try's marks under (sensors.drain.MARKS_KEY;
#: not imported: that module imports Airflow's task SDK, which the api-server need not load)
MARKS_KEY = "nats_ordered_drain_marks"


def _marks(value: Any) -> dict[str, int] | None:
    """``{partition: seq}`` from a mapping or a run record (``high_water_marks``); None for
    anything else ("now", a template not rendered yet)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, Mapping) and "high_water_marks" in value:
        value = value["high_water_marks"]
    if not isinstance(value, Mapping):
        return None
    try:
        return {str(int(p)): int(m) for p, m in value.items()}
    except (TypeError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def drain_sensors(session: Any, dag_id: str, run_id: str) -> list[dict[str, Any]] | None:
    """The run's drain sensor task instances as JSON-safe dicts (see the module), sorted by
    task id and map index; None if the DAG run does not exist."""
    from airflow._shared.state import TaskScope
    from airflow.models.dagrun import DagRun
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.models.xcom import XComModel
    from airflow.state import get_state_backend
    from sqlalchemy import select

    run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if run is None:
        return None
    tis = session.scalars(
        select(TaskInstance)
        .where(
            TaskInstance.dag_id == dag_id,
            TaskInstance.run_id == run_id,
            TaskInstance.operator == SENSOR,
        )
        .order_by(TaskInstance.task_id, TaskInstance.map_index)
    ).all()
    serialized = None
    out: list[dict[str, Any]] = []
    for ti in tis:
        rendered = RenderedTaskInstanceFields.get_templated_fields(ti, session=session) or {}
        fields = {k: rendered.get(k) for k in ("stream", "group", "high_water_marks", "run")}
        fields["nats_conn_id"] = rendered.get("nats_conn_id")
        is_rendered = bool(rendered)
        if not is_rendered:  # not run yet: the DAG's values, templates unrendered
            if serialized is None:
                serialized = SerializedDagModel.get_dag(dag_id, session=session)
            task = None
            if serialized is not None and serialized.has_task(ti.task_id):
                task = serialized.get_task(ti.task_id)
            for k in fields:
                fields[k] = getattr(task, k, None)
        marks: dict[str, int] | None = None
        source: str | None = None
        resolved_at: float | None = None
        conn_id = _text(fields["nats_conn_id"])
        state = str(ti.state.value if hasattr(ti.state, "value") else ti.state or "none")
        if state == "success":
            xcom = session.scalar(
                select(XComModel).where(
                    XComModel.dag_id == dag_id,
                    XComModel.run_id == run_id,
                    XComModel.task_id == ti.task_id,
                    XComModel.map_index == ti.map_index,
                    XComModel.key == "return_value",
                )
            )
            value = XComModel.deserialize_value(xcom) if xcom is not None else None
            if isinstance(value, Mapping) and (found := _marks(value.get("marks"))) is not None:
                marks, source = found, "xcom"
                fields["stream"] = value.get("stream") or fields["stream"]
                fields["group"] = value.get("group") or fields["group"]
        if marks is None and ti.trigger_id is not None:
            trigger = session.get(Trigger, ti.trigger_id)
            kwargs = trigger.kwargs if trigger is not None else {}
            if (found := _marks(kwargs.get("marks"))) is not None:
                marks, source = found, "trigger"
                conn_id = _text(kwargs.get("nats_conn_id")) or conn_id
        if marks is None:
            scope = TaskScope(
                dag_id=dag_id, run_id=run_id, task_id=ti.task_id, map_index=ti.map_index
            )
            raw = get_state_backend().get(scope, MARKS_KEY, session=session)
            try:
                kept = json.loads(raw) if raw is not None else None
            except ValueError:
                kept = None
            if (
                isinstance(kept, Mapping)
                and str(kept.get("ti_id")) == str(ti.id)
                and (found := _marks(kept.get("marks"))) is not None
            ):
                marks, source = found, "task_state_store"
                resolved_at = kept.get("resolved_at")
        if marks is None and fields["run"] in (None, "") and is_rendered:
            given = _marks(fields["high_water_marks"])
            if given is not None:
                marks, source = given, "high_water_marks"
        hwm = fields["high_water_marks"]
        out.append(
            {
                "task_id": ti.task_id,
                "map_index": ti.map_index,
                "try_number": ti.try_number,
                "state": state,
                "stream": _text(fields["stream"]),
                "group": _text(fields["group"]),
                "run": _text(fields["run"]),
                "high_water_marks": hwm if isinstance(hwm, str | int | float) else None,
                "rendered": is_rendered,
                "nats_conn_id": conn_id,
                "marks": marks,
                "marks_source": source,
                "marks_resolved_at": resolved_at,
            }
        )
    return out
