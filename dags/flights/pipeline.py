"""The ``flights_ordered_pipeline`` DAG, built by :func:`pipeline_dag` (the DAG file calls it
with the settings from the environment; tests call it with their own stream and sink).

One run per day of 2013::

    provision -> previous_day_drained -> publish (Spark) -> drained (deferrable) -> verify

* ``provision``: create-or-verify the partitioned stream (idempotent).
* ``previous_day_drained``: the day before was published completely (its run ledger
  record) and the worker group has committed everything it published. Running totals span
  days, so day D must be applied after day D-1 for every aircraft; this check refuses a day
  run out of order (a manual trigger, a backfill run backwards) whatever the scheduler does.
* ``publish``: ``spark-submit spark_apps/publish_flights.py`` for that day, keyed by
  ``tailnum`` in scheduled-departure order, under producer id ``<dag id>.publish.<logical
  date>``. The run ledger makes re-runs safe: a complete day is never published again
  (however long after: past the stream's duplicate window too), a partial one resumes.
  Flights without a tail number (cancelled) are refused and counted.
* ``drained``: waits in the triggerer until the group has committed up to the day's
  high-water marks (the publish XCom); fails fast on a poison message or no pool.
* ``verify``: every aircraft's running totals in the sink, up to that day, equal the Spark
  window-function reference (``spark_apps/reference_totals.py``); fails otherwise.

Order is enforced twice: by Airflow (``max_active_runs=1``; ``publish`` has
``depends_on_past`` and ``wait_for_downstream``, so day D publishes only after day D-1's
publish succeeded and its drain finished) and by ``previous_day_drained``, which reads
the ledger and the group's positions, so it holds for ``dag.test()`` and manual runs too.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowFailException

from airflow_nats_ordered.core.admin.drain import read_lag
from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.publish import default_producer_id
from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator
from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator
from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor
from flights.settings import FIRST_DAY, FlightsSettings

PUBLISH_TASK = "publish"


def publish_producer_id(dag_id: str, logical_date: dt.datetime) -> str:
    """The producer id under which the day of ``logical_date`` is published (the Spark
    operator's default: DAG id, task id, logical date)."""
    ti = SimpleNamespace(dag_id=dag_id, task_id=PUBLISH_TASK, map_index=-1)
    return default_producer_id({"ti": ti, "logical_date": logical_date})


def check_previous_day(dag_id: str, settings: FlightsSettings, logical_date: dt.datetime) -> dict:
    """Raise AirflowFailException unless the day before ``logical_date`` was published
    completely and the group has committed all of it (nothing to check on the first day)."""
    if logical_date.date() <= FIRST_DAY:
        return {"previous": None}
    previous = logical_date - dt.timedelta(days=1)
    producer_id = publish_producer_id(dag_id, previous)

    async def read(nc: Any) -> tuple[Any, Any]:
        ledger = await RunLedger.open(nc, settings.stream)
        return await ledger.get(producer_id), await read_lag(nc, settings.stream, settings.group)

    rec, lag = NatsHook(settings.nats_conn_id).run(read)
    day = previous.date().isoformat()
    if rec is None or rec.status != "complete":
        state = "was never published" if rec is None else f"is recorded {rec.status}"
        raise AirflowFailException(
            f"{day} {state} (run {producer_id!r}): running totals span days, so days run in "
            f"order; run {day} first (airflow backfill create --dag-id {dag_id} --from-date "
            f"{day} --to-date {logical_date.date()}), or clear it if it failed"
        )
    committed = {p.partition: p.committed for p in lag.partitions}
    behind = {p: m for p, m in rec.high_water_marks.items() if committed.get(int(p), 0) < m}
    if behind:
        raise AirflowFailException(
            f"group {settings.group} has not applied all of {day} yet (partition: mark "
            f"{behind}, committed {[committed.get(int(p), 0) for p in behind]}): wait for its "
            "drain (is the worker pool running?) and clear this task"
        )
    return {"previous": producer_id, "high_water_marks": rec.high_water_marks}


def pipeline_dag(
    dag_id: str = "flights_ordered_pipeline",
    settings: FlightsSettings | None = None,
    *,
    duplicate_window: float = 3600.0,
    drain_timeout: float = 3600.0,
    no_members_timeout: float = 120.0,
    **dag_kwargs: Any,
) -> DAG:
    """The daily pipeline over 2013 for ``settings`` (default: from the environment)."""
    s = settings or FlightsSettings.from_env()
    with DAG(
        dag_id=dag_id,
        schedule="@daily",
        start_date=dt.datetime.combine(FIRST_DAY, dt.time(), dt.UTC),
        end_date=dt.datetime.combine(s.last_day, dt.time(), dt.UTC),
        catchup=True,
        max_active_runs=1,
        tags=["nats", "spark", "flights"],
        doc_md=__doc__,
        **dag_kwargs,
    ) as dag:
        provision = NatsProvisionStreamOperator(
            task_id="provision",
            stream=s.stream,
            partitions=s.partitions,
            replicas=s.replicas,
            duplicate_window=duplicate_window,
            nats_conn_id=s.nats_conn_id,
        )

        @task
        def previous_day_drained(**context: Any) -> dict:
            """The day before was published completely and the group applied all of it."""
            return check_previous_day(context["dag"].dag_id, s, context["logical_date"])

        publish = NatsSparkPublishOperator(
            task_id=PUBLISH_TASK,
            application=str(Path(s.spark_apps) / "publish_flights.py"),
            application_args=["--start", "{{ ds }}", "--allow-refused"],
            stream=s.stream,
            nats_conn_id=s.nats_conn_id,
            conn_id=s.spark_conn_id,
            conf={"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"},
            name="publish_flights_{{ ds }}",
            depends_on_past=True,
            wait_for_downstream=True,
        )
        drained = NatsGroupDrainSensor(
            task_id="drained",
            stream=s.stream,
            group=s.group,
            high_water_marks=publish.output,
            no_members_timeout=no_members_timeout,
            timeout=drain_timeout,
            nats_conn_id=s.nats_conn_id,
            deferrable=True,  # waits in the triggerer, no worker slot held
        )

        @task
        def verify(published: dict, **context: Any) -> dict:
            """Every aircraft's running totals up to this day equal the Spark reference."""
            from flights.verify import verify_day

            day = context["logical_date"].date()
            v = verify_day(day, s.sink_path(), s.spark_apps)
            result = {
                **v.to_dict(),
                "published": published.get("acked"),
                "refused": published.get("refused"),
            }
            if not v.verified:
                raise AirflowFailException(
                    f"{day}: the sink differs from the Spark reference: {result}; a double "
                    "count or an ordering slip; see the worker pool's log"
                )
            print(f"verified {day}: {v.aircraft} aircraft, {v.flights} flights up to this day")
            return result

        provision >> previous_day_drained() >> publish >> drained
        drained >> verify(publish.output)
    return dag
