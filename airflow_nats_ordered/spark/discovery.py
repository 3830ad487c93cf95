"""How a Spark session finds ``format("nats-ordered")``, in any directory and any thread.

Guarantees, in an environment where this package is installed (editable or from a wheel):

* **Found without** :func:`register`. Spark 4 registers, once per application, every
  top-level module named ``pyspark_*`` that ``pkgutil.iter_modules()`` lists and that defines
  ``DefaultSource``: ``pyspark_nats_ordered`` is one. ``iter_modules()`` sees ``sys.path``
  entries only (not import hooks), so the editable install puts the project directory on
  ``sys.path`` with a plain ``.pth`` line (``package-dir`` in ``pyproject.toml``); a wheel
  puts the package in site-packages. Spark runs that lookup with ``PYSPARK_PYTHON`` (else
  ``python3`` from ``PATH``): it must be this environment's interpreter, as for the tasks.
* **Found from any thread.** Spark decides whether a name is a Python data source with the
  JVM thread's *active* session, not the writer's session, and a new Python thread talks to
  a new JVM thread that has none: ``format("nats-ordered")`` there failed with
  ``DATA_SOURCE_NOT_FOUND`` even in a session that had the source (registered or found).
  Once this package is imported, ``df.write.format("nats-ordered")`` and
  ``df.writeStream.format("nats-ordered")`` make the writer's own session the active one of
  the calling thread first; :func:`register` and
  :func:`~airflow_nats_ordered.spark.write_ordered` do the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from airflow_nats_ordered.spark.datasource import NAME, NatsOrderedDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def use_in_this_thread(spark: SparkSession) -> None:
    """Make ``spark`` the active session of the calling thread's JVM thread (classic
    PySpark), where Spark looks Python data sources up. Spark Connect sessions resolve
    formats on the server: nothing to do for them."""
    jvm = getattr(spark, "_jvm", None)
    jsession = getattr(spark, "_jsparkSession", None)
    if jvm is None or jsession is None:
        return
    getattr(jvm, "org.apache.spark.sql.classic.SparkSession").setActiveSession(jsession)


def _has_format(spark: SparkSession) -> bool:
    """Whether ``spark`` already has the format (found by Spark's lookup or registered)."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:  # Spark Connect: ask the server by registering
        return False
    return bool(jsession.sessionState().dataSourceManager().dataSourceExists(NAME))


def register(spark: SparkSession) -> None:
    """Make ``format("nats-ordered")`` available in ``spark`` from the calling thread
    (idempotent). Needed only where Spark's own lookup cannot see ``pyspark_nats_ordered``
    (a ``--py-files`` zip without it, a ``PYSPARK_PYTHON`` of another environment); a
    session that has the format already is left as it is (re-registering over the found
    source would log a warning on every call)."""
    use_in_this_thread(spark)
    if not _has_format(spark):
        spark.dataSource.register(NatsOrderedDataSource)


def _activating(format_method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(format_method)
    def format(self: Any, source: str) -> Any:
        if isinstance(source, str) and source.strip().lower() == NAME:
            use_in_this_thread(self._spark)
        return format_method(self, source)

    format.__nats_ordered_activating__ = True  # type: ignore[attr-defined]
    return format


def _activate_on_format() -> None:
    """Let the writers of classic PySpark make their session active when given this
    format (see the module docstring: Spark's lookup reads the thread's active session)."""
    from pyspark.sql.readwriter import DataFrameWriter
    from pyspark.sql.streaming.readwriter import DataStreamWriter

    for writer in (DataFrameWriter, DataStreamWriter):
        method = writer.format
        if not getattr(method, "__nats_ordered_activating__", False):
            setattr(writer, "format", _activating(method))  # noqa: B010


_activate_on_format()
