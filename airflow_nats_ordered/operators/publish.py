"""Publish records to a partitioned stream as a named run, from a DAG."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.config import PublisherConfig, check_producer_id
from airflow_nats_ordered.core.publish.runs import RunResult, publish_run
from airflow_nats_ordered.hooks.arguments import refuse_unknown_operator_arguments
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.inputs.files import open_records, records_from_rows
from airflow_nats_ordered.inputs.records import InputRecord
from airflow_nats_ordered.operators.failures import failing_at_once
from airflow_nats_ordered.operators.lineage import NatsLineageMixin


def import_callable(ref: Callable[..., Any] | str, what: str) -> Callable[..., Any]:
    """A callable, or one named ``package.module:function`` / ``package.module.function``."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{what} must be a callable or a dotted path, got {ref!r}")
    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, _, attr = ref.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{what} {ref!r} cannot be imported: {exc}") from None
    if not callable(obj):
        raise ConfigError(f"{what} {ref!r} is not callable")
    return obj


def default_producer_id(context: Mapping[str, Any]) -> str:
    """``<dag id>.<task id>[.<map index>].<logical date or run id>``: stable across task
    retries and clear-and-rerun of the same run, different for every other run."""
    ti = context["ti"]
    logical = context.get("logical_date")
    when = logical.isoformat() if logical is not None else context["run_id"]
    index = getattr(ti, "map_index", -1)
    mapped = f".{index}" if index is not None and index >= 0 else ""
    return f"{ti.dag_id}.{ti.task_id}{mapped}.{when}"


def checked_producer_id(
    task_id: Any, producer_id: Any, operator: str = "NatsPublishOperator"
) -> str:
    """An operator's ``producer_id``; an empty or blank one (an unset variable, a template
    that rendered empty) is refused naming the parameter, never replaced by the default."""
    try:
        return check_producer_id(
            str(producer_id),
            "producer_id",
            "the default <dag id>.<task id>.<logical date>",
        )
    except ConfigError as exc:
        raise ConfigError(f"{operator} {task_id!r}: {exc}") from None


class NatsPublishOperator(NatsLineageMixin, BaseOperator):
    """Publish records keyed to partitions, in order per key, as one run.

    Records come from exactly one of: ``path`` (JSON lines, CSV or Parquet, as the CLI
    reads them), ``records`` (a list of dicts, e.g. an upstream task's XCom), or
    ``records_callable`` (a callable or ``"pkg.module:function"`` returning dicts, called
    with ``op_kwargs``). ``key_field`` names the key column; ``order_by`` sorts (stably)
    before publishing; ``msg_id_field`` supplies msg-ids instead of derived ones.

    The run is recorded in the stream's run ledger under ``producer_id`` (default: DAG id,
    task id and the run's logical date), so a task retry resumes after what was stored and a
    cleared-and-rerun task of a complete run publishes nothing, even long after the
    stream's duplicate window. Returns the run record (counts, per-partition high-water
    marks for :class:`~airflow_nats_ordered.sensors.drain.NatsGroupDrainSensor`). The marks
    cover every partition the run stored, including what an earlier (failed or killed)
    try stored: a drain on a retried run's XCom waits for all of it. Failed records fail
    the try (a retry resumes the run); so does a run whose mark of a stored partition could
    not be read (the next try reads it again). Refused records (no key, too large) fail the
    task at once, without a retry, unless ``allow_refused``; so do bad arguments or input, a
    missing stream and an ``expected_partitions`` that differs from the stream's
    (:mod:`.failures` lists what fails at once).

    ``global_order=True`` stamps every record with a global sequence (``Nats-Global-Seq``,
    publish order over all partitions) and writes watermarks, for
    :class:`~airflow_nats_ordered.core.order.reader.GlobalOrderReader`; one such publisher
    per stream at a time (a second fails at once). A retried try keeps what the failed one
    stored, with its sequence, and numbers what it sends above everything stored.

    ``stream_outlet=True`` makes the stream the task's outlet asset ``nats://<STREAM>``
    (a DAG scheduled on it runs after each successful publish; the event's extra has the
    run's producer id and high-water marks); a templated stream needs an ``AssetAlias`` in
    ``outlets`` (see :mod:`.lineage`). OpenLineage sees the stream as the output dataset.
    """

    template_fields: Sequence[str] = (
        "stream",
        "path",
        "records",
        "key_field",
        "order_by",
        "msg_id_field",
        "producer_id",
        "op_kwargs",
        "nats_conn_id",
    )
    template_fields_renderers = {"records": "json", "op_kwargs": "json"}
    ui_color = "#c8d7f0"

    def __init__(
        self,
        *,
        stream: str,
        key_field: str | None = None,
        path: str | None = None,
        records: Any = None,
        records_callable: Callable[..., Iterable[Mapping[str, Any]]] | str | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        order_by: Sequence[str] | str | None = None,
        msg_id_field: str | None = None,
        input_format: str | None = None,
        producer_id: str | None = None,
        allow_refused: bool = False,
        allow_keyless: bool = False,
        publisher_config: Mapping[str, Any] | None = None,
        expected_partitions: int | None = None,
        global_order: bool = False,
        nats_conn_id: str = NatsHook.default_conn_name,
        stream_outlet: bool = False,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(**kwargs)
        given = [
            n
            for n, v in (
                ("path", path),
                ("records", records),
                ("records_callable", records_callable),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ConfigError(
                f"NatsPublishOperator {kwargs.get('task_id')!r}: pass exactly one of path, "
                f"records or records_callable (got {', '.join(given) or 'none'})"
            )
        if key_field is None and not allow_keyless:
            raise ConfigError(
                f"NatsPublishOperator {kwargs.get('task_id')!r}: key_field is required (the "
                "column holding each record's partition key), or allow_keyless=True for "
                "round-robin without per-key order"
            )
        if producer_id is not None:
            checked_producer_id(kwargs.get("task_id"), producer_id)
        self.stream = stream
        self.key_field = key_field
        self.path = path
        self.records = records
        self.records_callable = records_callable
        self.op_kwargs = dict(op_kwargs or {})
        self.order_by = order_by
        self.msg_id_field = msg_id_field
        self.input_format = input_format
        self.producer_id = producer_id
        self.allow_refused = allow_refused
        self.allow_keyless = allow_keyless
        self.publisher_config = dict(publisher_config or {})
        self.expected_partitions = expected_partitions
        self.global_order = bool(global_order)
        self.nats_conn_id = nats_conn_id
        self.declare_stream_outlet(stream_outlet)

    def _records(self) -> Iterator[InputRecord]:
        if self.path is not None:
            with open_records(
                self.path,
                key_field=self.key_field,
                fmt=self.input_format,
                msg_id_field=self.msg_id_field,
                order_by=self.order_by,
                python_terms=True,  # errors name key_field, not the CLI's --key-field
            ) as reader:
                yield from reader
            return
        rows = self.records
        if rows is None:
            assert self.records_callable is not None  # __init__ requires exactly one source
            rows = import_callable(self.records_callable, "records_callable")(**self.op_kwargs)
        yield from records_from_rows(
            rows, key_field=self.key_field, msg_id_field=self.msg_id_field, order_by=self.order_by
        )

    def execute(self, context: Any) -> dict[str, Any]:
        # bad arguments or input, a missing stream, a partition-count mismatch: no retry
        # fixes them (see failures.py); records not confirmed as stored stay retryable
        with failing_at_once():
            return self.record_stream_event(context, self._publish(context))

    def _publisher_config(self, producer_id: str) -> PublisherConfig:
        own = {"producer_id", "allow_keyless", "global_order"}  # the operator's own arguments
        known = {f.name for f in dataclasses.fields(PublisherConfig)} - own
        unknown = sorted(set(self.publisher_config) - known)
        if unknown:
            raise ConfigError(
                f"NatsPublishOperator {self.task_id!r}: publisher_config has unknown "
                f"setting(s) {', '.join(unknown)}; valid ones: {', '.join(sorted(known))} "
                "(producer_id, allow_keyless and global_order are arguments of the operator "
                "itself)"
            )
        knobs = {
            **self.publisher_config,
            "allow_keyless": self.allow_keyless,
            "global_order": GlobalOrder() if self.global_order else None,
        }
        return PublisherConfig(**knobs, producer_id=producer_id)

    def _publish(self, context: Any) -> dict[str, Any]:
        # checked again once rendered: a template can render empty
        producer_id = (
            default_producer_id(context)
            if self.producer_id is None
            else checked_producer_id(self.task_id, self.producer_id)
        )
        config = self._publisher_config(producer_id)
        hook = NatsHook(self.nats_conn_id)
        hook.get_options()  # read the connection before the loop starts (clear errors first)

        async def run(nc: Any) -> RunResult:
            return await publish_run(
                nc,
                self.stream,
                self._records(),
                producer_id=producer_id,
                config=config,
                allow_refused=self.allow_refused,
                msg_id_field=self.msg_id_field,
                expected_partitions=self.expected_partitions,
            )

        result = hook.run(run)
        rec = result.record
        if result.skipped:
            self.log.info(
                "run %r is complete in the ledger of %s (%d records acknowledged at attempt %d):"
                " nothing published",
                producer_id,
                self.stream,
                rec.acked,
                rec.attempts,
            )
        else:
            self.log.info(
                "run %r: %d records acknowledged (%d skipped as stored by an earlier attempt), "
                "%d failed, %d refused, %d duplicates; high-water marks %s",
                producer_id,
                rec.acked,
                rec.skipped,
                rec.failed,
                rec.refused,
                rec.duplicates,
                rec.high_water_marks,
            )
        out = result.to_dict()
        if rec.failed:
            raise RuntimeError(
                f"run {producer_id!r}: {rec.failed} records were not confirmed as stored "
                f"({rec.error}); retrying the task resumes the run without storing anything twice"
            )
        if rec.refused and not self.allow_refused:
            examples = "; ".join(f"{e['where']}: {e['reason']}" for e in rec.refused_examples)
            raise AirflowFailException(  # the same input is refused again on every retry
                f"run {producer_id!r}: {rec.refused} records were refused before sending "
                f"({examples}); fix the input (key_field={self.key_field!r}) or pass "
                "allow_refused=True to publish the rest and succeed"
            )
        if rec.status != "complete":
            # e.g. the mark of a stored partition could not be read: a drain on this XCom
            # would not wait for that partition, so the task must not succeed with it
            raise RuntimeError(
                f"run {producer_id!r} is {rec.status}: {rec.error}; retrying the task resumes "
                "the run without storing anything twice"
            )
        return out


__all__ = ["NatsPublishOperator", "default_producer_id", "import_callable"]
