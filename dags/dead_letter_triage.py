"""Airflow DAG ``dead_letter_triage``: started by the ``nats://`` AssetWatcher on the flights
group's dead-letter subject (``<STREAM>_DLQ``), one run per poison message; the task log shows
the message, its error and headers. See :func:`flights.operations.triage_dag`.

Importing this file needs no NATS server: the connection is opened by the triggerer. Unpause
it before ``<STREAM>_DLQ`` exists (before a worker of the group started) and the watcher
logs once that it waits for the stream and what creates it, then reads it once it appears."""

from flights.operations import triage_dag

dag = triage_dag()
