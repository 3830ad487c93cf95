"""Airflow DAG ``dead_letter_triage``: started by the ``nats://`` AssetWatcher on the flights
group's dead-letter subject (``<STREAM>_DLQ``), one run per poison message; the task log shows
the message, its error and headers. See :func:`flights.operations.triage_dag`.

Importing this file needs no NATS server: the connection is opened by the triggerer."""

from flights.operations import triage_dag

dag = triage_dag()
