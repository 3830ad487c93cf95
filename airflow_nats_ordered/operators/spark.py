"""Submit a PySpark publish job (e.g. ``spark_apps/publish_flights.py``) as a named run."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowFailException

from airflow_nats_ordered.core.connection.environment import SPARK_ENV_VARS, spark_env
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.runs import RunLedger, RunRecord
from airflow_nats_ordered.hooks.arguments import refuse_unknown_operator_arguments
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.failures import failing_at_once
from airflow_nats_ordered.operators.lineage import NatsLineageMixin
from airflow_nats_ordered.operators.publish import checked_producer_id, default_producer_id


def nats_env(options: ConnectionOptions) -> dict[str, str]:
    """The environment that gives a Spark driver exactly these connection options: every
    ``NATS_*`` variable it reads
    (:data:`~airflow_nats_ordered.core.connection.environment.SPARK_ENV_VARS`),
    set from ``options`` or emptied (empty means unset), so a ``NATS_*`` variable of the
    Airflow worker's own environment cannot mix in. Holds secrets: an environment only."""
    return {**dict.fromkeys(SPARK_ENV_VARS, ""), **spark_env(options)}


class NatsSparkPublishOperator(NatsLineageMixin, SparkSubmitOperator):
    """``spark-submit`` a publish job and push the run's ledger record to XCom.

    The application is called with ``--stream <stream> --producer-id <id>`` after its own
    ``application_args`` (``spark_apps/publish_flights.py`` takes them) and publishes with the
    ``nats-ordered`` sink, which records the run under that producer id (default: DAG id, task
    id, logical date: the same on task retries and clear-and-rerun, so a complete run is never
    published again and a partial one resumes). Returns the record (status, counts,
    ``high_water_marks`` for :class:`~airflow_nats_ordered.sensors.drain.NatsGroupDrainSensor`).

    The NATS connection ``nats_conn_id``, every field of it (servers, credentials, TLS
    files, ``tls_hostname``, ``tls_verify``, timeouts, ``name``, reconnect settings, inbox
    prefix, JetStream domain or API prefix), reaches
    the driver as ``NATS_*`` environment variables of the spark-submit process (see
    :mod:`airflow_nats_ordered.core.connection.environment`), never on its command line or in a
    Spark
    conf; the driver resolves them once and its tasks use that copy, so executors (a
    standalone cluster's too) need no NATS environment. Files the connection names (creds,
    CA, certificate, key; a ``*_secret`` content extra becomes a private file on the Airflow
    worker) must exist at the same path on the executor hosts. Masters/modes where the Spark
    provider would turn ``env_vars`` into ``--conf`` (YARN, Kubernetes, cluster deploy
    mode) are refused. Sets ``PYSPARK_PYTHON`` (default: this interpreter),
    ``spark.speculation=false`` (speculative copies would publish twice, out of order) and
    puts this interpreter's ``bin`` folder first on ``PATH`` so its ``spark-submit`` runs.

    Lineage as :class:`~.publish.NatsPublishOperator`: ``stream_outlet=True`` makes the
    stream the task's outlet asset ``nats://<STREAM>`` (a templated stream needs an
    ``AssetAlias`` in ``outlets``), and OpenLineage sees the stream as the output dataset.
    """

    template_fields: Sequence[str] = (
        *SparkSubmitOperator.template_fields,
        "stream",
        "producer_id",
        "nats_conn_id",
    )
    template_fields_renderers = {
        **SparkSubmitOperator.template_fields_renderers,
        "conf": "json",
        "application_args": "json",
    }
    ui_color = "#f4a460"

    def __init__(
        self,
        *,
        application: str,
        stream: str,
        producer_id: str | None = None,
        nats_conn_id: str = NatsHook.default_conn_name,
        pyspark_python: str | None = None,
        stream_outlet: bool = False,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(application=application, **kwargs)
        self.stream = stream
        self.producer_id = producer_id
        self.nats_conn_id = nats_conn_id
        self.pyspark_python = pyspark_python or sys.executable
        self.declare_stream_outlet(stream_outlet)

    def _refuse_env_as_conf(self) -> None:
        # read from the Spark connection as the provider's hook reads it, without building
        # the hook (it needs the Kubernetes client just to be created for a k8s master)
        conn = BaseHook.get_connection(self._conn_id)
        master = f"{conn.conn_type}://{conn.host or ''}"
        mode = self._deploy_mode or (conn.extra_dejson or {}).get("deploy-mode")
        if "yarn" in master or "k8s" in master or mode == "cluster":
            raise ConfigError(
                f"NatsSparkPublishOperator {self.task_id!r}: with Spark connection "
                f"{self._conn_id!r} ({conn.host}, deploy mode {mode or 'client'}) the Spark "
                "provider passes env_vars as --conf settings, which the Spark UI and the "
                "process list show, so the NATS credentials would leak; submit in client mode "
                "to a local or spark:// master, or run a SparkSubmitOperator whose cluster "
                "provides the NATS_* variables as secrets"
            )

    def prepare(self, producer_id: str) -> NatsHook:
        """Settle conf, env_vars and application_args for ``producer_id`` (after templates are
        rendered, so the NATS variables never reach the rendered fields); refuse unsafe
        settings before anything is submitted. Returns the NATS hook."""
        conf: dict[Any, Any] = dict(self.conf or {})
        if str(conf.get("spark.speculation", "false")).lower() != "false":
            raise ConfigError(
                f"NatsSparkPublishOperator {self.task_id!r}: spark.speculation must stay false "
                "(a speculative task copy publishes the same partition a second time)"
            )
        conf["spark.speculation"] = "false"
        self.conf = conf
        self._refuse_env_as_conf()
        hook = NatsHook(self.nats_conn_id)
        bin_dir = os.path.dirname(sys.executable)
        self.env_vars = {
            **(self.env_vars or {}),
            **nats_env(hook.get_options()),
            "PYSPARK_PYTHON": self.pyspark_python,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.application_args = [
            *(self.application_args or []),
            "--stream",
            self.stream,
            "--producer-id",
            producer_id,
        ]
        self._hook = None  # built again with the settings above
        return hook

    # the run's ledger record goes to XCom as execute's return value (the Spark provider's
    # operator returns nothing, so its annotation says None)
    def execute(self, context: Any) -> dict[str, Any]:  # type: ignore[override]
        # unsafe or bad settings, a missing stream: no retry fixes them (see failures.py);
        # a failed spark-submit stays retryable (the run resumes)
        with failing_at_once():
            return self.record_stream_event(context, self._submit(context))

    def _submit(self, context: Any) -> dict[str, Any]:
        # an empty one (a template that rendered empty) is refused, never the default's
        producer_id = (
            default_producer_id(context)
            if self.producer_id is None
            else checked_producer_id(self.task_id, self.producer_id, type(self).__name__)
        )
        hook = self.prepare(producer_id)

        async def read(nc: Any) -> RunRecord | None:
            return await (await RunLedger.open(nc, self.stream)).get(producer_id)

        done = hook.run(read)
        if done is not None and done.status == "complete":
            # a cleared or backfilled run that already published: no job, nothing stored
            self.log.info(
                "run %r is complete in the ledger of %s (%d rows acknowledged): not "
                "submitting the job again",
                producer_id,
                self.stream,
                done.acked,
            )
            return {**done.to_dict(), "already_complete": True}
        super().execute(context)
        rec = hook.run(read)
        if rec is None:
            raise AirflowFailException(  # the same application does the same on a retry
                f"the Spark job finished but run {producer_id!r} has no record in the ledger of "
                f"{self.stream}: does {self.application} publish with the nats-ordered sink and "
                "the --stream/--producer-id it is given?"
            )
        if rec.status != "complete":
            raise RuntimeError(
                f"run {producer_id!r} is recorded {rec.status}: {rec.error}; retrying the task "
                "resumes it without storing anything twice"
            )
        self.log.info(
            "run %r: %d rows acknowledged (%d duplicates dropped), %d refused; high-water marks %s",
            producer_id,
            rec.acked,
            rec.duplicates,
            rec.refused,
            rec.high_water_marks,
        )
        return rec.to_dict()


__all__ = ["NatsSparkPublishOperator", "nats_env"]
