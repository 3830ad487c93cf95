"""Lineage of the publish operators: the stream they write, as an Airflow outlet asset and as
an OpenLineage output dataset.

:class:`NatsLineageMixin` gives an operator with a ``stream`` and a ``nats_conn_id``
attribute (other names: set ``lineage_stream_attr`` / ``lineage_conn_id_attr``):

* ``get_openlineage_facets_on_start`` / ``_on_complete``, which the OpenLineage provider's
  default extractor calls (once templates are rendered): one output dataset, namespace
  ``nats://<host>:<port>`` of the connection's first server, name the stream. The
  namespace is built from the host and port only: never a user, password or token.
  Without the OpenLineage provider they return None, as Airflow's own providers do.
* :func:`convert_asset_to_openlineage`, the provider's ``to_openlineage_converter`` for
  ``nats://`` assets (another task's inlets/outlets, hook lineage): the same dataset for
  the same stream and connection.
* :meth:`~NatsLineageMixin.declare_stream_outlet` (called at the end of ``__init__``) and
  :meth:`~NatsLineageMixin.record_stream_event` (called with the task's result at the end
  of ``execute``): with ``stream_outlet=True`` the stream becomes the task's outlet asset
  ``Asset("nats://<STREAM>")``, so a DAG scheduled on that asset runs after each
  successful publish.

Outlets are opt-in: an outlet makes every successful publish an asset event, which starts
the runs of every DAG scheduled on the asset, so declaring it silently would change what
existing deployments schedule (a DAG that watches ``nats://ORDERS`` with an AssetWatcher
would get one more run per publish). A templated ``stream`` (or one from an XComArg) is
only known when the task runs, after Airflow has read the outlets from the DAG file, and so
is any stream of a mapped task (``.partial().expand()``: Airflow reads the outlets of
``.partial()``): they need an ``AssetAlias`` among the task's ``outlets``, to which the
task attaches ``Asset("nats://<rendered stream>")`` when it succeeds.

Guaranteed: the asset event of a publish carries, in its ``extra``, the run's
``producer_id``, ``status``, ``acked``, ``high_water_marks`` and ``already_complete`` (what
a downstream drain needs), never connection settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from airflow.sdk import Asset, AssetAlias

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.hooks.nats import NatsHook

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

#: the run record's fields an asset event carries (in its ``extra``)
EVENT_FIELDS = ("producer_id", "status", "acked", "high_water_marks", "already_complete")

#: a server URL's port when it names none, by scheme (the nats client's defaults)
_DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "ws": 80, "wss": 443}


def stream_asset(stream: str) -> Asset:
    """``Asset("nats://<stream>")``, the asset a publish to ``stream`` is an event of.

    Schedule a DAG on exactly this form: Airflow tells assets apart by name too, so
    ``Asset("nats://ORDERS/")`` (trailing slash) is another asset. A stream name the
    ``nats`` asset URI handler refuses is a ConfigError naming ``stream``."""
    try:
        return Asset(f"nats://{stream}")
    except ValueError as exc:
        raise ConfigError(f"stream {stream!r} cannot be an outlet asset: {exc}") from None


def is_templated(value: Any) -> bool:
    """Whether ``value`` is only known when the task runs: a Jinja template or an XComArg."""
    if not isinstance(value, str):
        return True
    return "{{" in value or "{%" in value


def lineage_namespace(servers: tuple[str, ...] | list[str]) -> str:
    """``nats://<host>:<port>`` of the first server: the OpenLineage namespace of the
    streams of a NATS deployment (the Kafka provider's ``kafka://<host>:<port>``). Only
    host and port are read, so credentials in the URL never reach it."""
    parts = urlsplit(servers[0] if "://" in servers[0] else f"nats://{servers[0]}")
    host = (parts.hostname or "127.0.0.1").lower()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 4222)
    return f"nats://{host}:{port}"


def stream_dataset(nats_conn_id: str, stream: str) -> Any:
    """The OpenLineage dataset of ``stream`` on the deployment of connection
    ``nats_conn_id``: namespace :func:`lineage_namespace` of its servers, name the stream.
    What the publish operators report and what :func:`convert_asset_to_openlineage` makes
    of ``nats://<stream>``, so the two are one dataset."""
    from airflow.providers.common.compat.openlineage.facet import Dataset

    options = NatsHook(nats_conn_id).get_options()
    return Dataset(namespace=lineage_namespace(options.servers), name=stream)


def convert_asset_to_openlineage(asset: Asset, lineage_context: Any) -> Any:
    """The provider's ``to_openlineage_converter`` for ``nats://<STREAM>[/<path>]`` assets:
    the stream's dataset (:func:`stream_dataset`), the path dropped (it names a group or a
    subject of the one stream). The asset URI names no server, so the connection is, in
    order: the hook that reported the asset (hook lineage), the asset's
    ``extra["nats_conn_id"]``, else ``nats_default``. A connection that cannot be read
    raises, and the OpenLineage provider then leaves the asset out (a debug line) rather
    than report it in a made-up namespace. Never reads a user, password or token."""
    parts = urlsplit(asset.uri)
    stream = parts.netloc
    if parts.scheme != "nats" or not stream or "@" in stream or ":" in stream:
        raise ValueError(f"not a nats://<STREAM>[/<path>] asset URI: {asset.uri!r}")
    if isinstance(lineage_context, NatsHook):
        conn_id = str(lineage_context.nats_conn_id)
    else:
        conn_id = str((asset.extra or {}).get("nats_conn_id") or NatsHook.default_conn_name)
    return stream_dataset(conn_id, stream)


class NatsLineageMixin:
    """Outlet asset and OpenLineage facets for an operator that publishes to one stream.

    Put it first among the bases (``class Op(NatsLineageMixin, BaseOperator)``); the
    operator calls :meth:`declare_stream_outlet` at the end of ``__init__`` and returns
    :meth:`record_stream_event`'s value from ``execute``.
    """

    lineage_stream_attr = "stream"
    lineage_conn_id_attr = "nats_conn_id"
    outlets: list[Any]
    task_id: str

    def _lineage_stream(self) -> Any:
        return getattr(self, self.lineage_stream_attr)

    def declare_stream_outlet(self, stream_outlet: bool) -> None:
        """With ``stream_outlet``: add ``Asset("nats://<stream>")`` to the task's outlets (a
        literal stream), or check that an ``AssetAlias`` is there to receive it at run time
        (a templated one). Raises ConfigError naming the parameters to change."""
        self.stream_outlet = bool(stream_outlet)
        if not self.stream_outlet:
            return
        stream = self._lineage_stream()
        name = f"{type(self).__name__} {self.task_id!r}"
        # a mapped task (.partial().expand()) is created again for each map index when it
        # runs: Airflow read its outlets from .partial(), where nothing was added
        mapped = getattr(self, "_BaseOperator__from_mapped", False)
        if is_templated(stream) or mapped:
            if not any(isinstance(o, AssetAlias) for o in self.outlets):
                why = "the task is mapped" if mapped else f"stream {stream!r} is templated"
                raise ConfigError(
                    f"{name}: {why}, so the stream is not known when Airflow reads the DAG's "
                    "outlets; with stream_outlet=True also pass outlets=[AssetAlias('<name>')]:"
                    " the task attaches Asset('nats://<rendered stream>') to it when it "
                    "succeeds (schedule the consumer on that asset or on the alias), or give "
                    "a literal stream to an unmapped task"
                )
            return
        try:
            asset = stream_asset(stream)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if asset not in self.outlets:
            self.outlets.append(asset)

    def record_stream_event(self, context: Mapping[str, Any], record: Any) -> Any:
        """Give the stream's asset event of this run the run record's :data:`EVENT_FIELDS`
        (and attach it to the ``AssetAlias`` outlets when the stream was templated);
        returns ``record`` unchanged. Airflow emits the event only if the task succeeds."""
        if not getattr(self, "stream_outlet", False):
            return record
        extra = {k: record[k] for k in EVENT_FIELDS if isinstance(record, dict) and k in record}
        asset = stream_asset(self._lineage_stream())  # rendered by now
        events = context["outlet_events"]
        if asset in self.outlets:
            events[asset].extra.update(extra)
        else:
            for alias in (o for o in self.outlets if isinstance(o, AssetAlias)):
                events[alias].add(asset, extra=extra)
        return record

    def get_openlineage_facets_on_start(self) -> OperatorLineage | None:
        """One output dataset: namespace ``nats://<host>:<port>`` of the connection's first
        server, name the stream. None without the OpenLineage provider."""
        try:
            from airflow.providers.openlineage.extractors import OperatorLineage
        except ImportError:
            return None
        conn_id = getattr(self, self.lineage_conn_id_attr)
        return OperatorLineage(outputs=[stream_dataset(conn_id, self._lineage_stream())])

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage | None:
        """The same dataset as on start (a publish writes the one stream it names)."""
        return self.get_openlineage_facets_on_start()


__all__ = [
    "EVENT_FIELDS",
    "NatsLineageMixin",
    "convert_asset_to_openlineage",
    "is_templated",
    "lineage_namespace",
    "stream_asset",
    "stream_dataset",
]
