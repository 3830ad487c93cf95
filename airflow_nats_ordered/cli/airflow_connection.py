"""``--conn-id``: a command's connection settings from an Airflow connection of type ``nats``.

Looked up as the Airflow CLI (``airflow connections get``) does: ``AIRFLOW_CONN_<ID>``
variables and the configured secrets backends (through :class:`NatsHook`, the lookup of
Airflow 3's SDK outside a task), then Airflow's metadata database, where ``airflow
connections add`` and the UI store connections. Airflow 3's SDK lookup outside a task does
not read that database, so without this step a connection the user had just added was
"not defined". Airflow is imported only here: every other command line works without it.
Errors name the connection and what to fix, never a secret.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError

#: connection flags (argparse dests) that --conn-id replaces
_FLAG_DESTS = (
    "server",
    "creds",
    "nkey",
    "user",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "connect_timeout",
    "inbox_prefix",
    "js_domain",
    "js_api_prefix",
)


def airflow_connection_options(args: argparse.Namespace) -> ConnectionOptions:
    """The options of Airflow connection ``--conn-id``: from ``AIRFLOW_CONN_*`` variables,
    the secrets backends, or else Airflow's metadata database (the order of Airflow's own
    lookup). Raises ConfigError saying what to fix: flags combined with it, Airflow missing,
    a connection found nowhere (with why the database could not be read, if it could not),
    or a field of the connection that is wrong."""
    conn_id = args.conn_id
    given = [f"--{d.replace('_', '-')}" for d in _FLAG_DESTS if getattr(args, d, None)]
    if given:
        raise ConfigError(
            f"--conn-id {conn_id} takes every connection setting from the Airflow connection; "
            f"drop {', '.join(given)} (or drop --conn-id and give the flags)"
        )
    try:
        from airflow.sdk.exceptions import AirflowNotFoundException

        from airflow_nats_ordered.hooks.nats import NatsHook
    except ImportError as exc:
        raise ConfigError(
            f"--conn-id {conn_id} reads an Airflow connection, but Airflow cannot be imported "
            f"({exc}); install it (pip install 'airflow-nats-ordered[airflow]') or give the "
            "connection with --server/--creds/--user... flags or NATS_* variables"
        ) from None
    _airflow_logs_to_stderr()
    try:
        return NatsHook(conn_id).get_options()
    except AirflowNotFoundException:
        pass
    conn, db_problem = connection_from_metadata_db(conn_id)
    if conn is not None:
        return NatsHook.options_of(conn_id, conn)
    why = (
        f" (Airflow's metadata database was not read: {db_problem}; check AIRFLOW_HOME and "
        "[database] sql_alchemy_conn, and run `airflow db migrate`)"
        if db_problem
        else ""
    )
    raise ConfigError(
        f"Airflow connection {conn_id!r} is not defined{why}: add it (`airflow connections add "
        f"{conn_id} --conn-type nats --conn-host HOST:4222`, or the environment variable "
        f"AIRFLOW_CONN_{conn_id.upper()} as JSON or URI; one that does not parse reads as "
        "not defined) or pass the right --conn-id"
    ) from None


def connection_from_metadata_db(conn_id: str) -> tuple[Any, str | None]:
    """``(connection, None)`` if Airflow's metadata database holds ``conn_id``, ``(None,
    None)`` if it does not, ``(None, why)`` if it could not be read (no database, not
    migrated, unreachable): ``why`` is the error's class and first line, which names no
    secret (the database URL is not part of it)."""
    try:
        from airflow.secrets.metastore import MetastoreBackend

        return MetastoreBackend().get_connection(conn_id), None
    except Exception as exc:
        orig = getattr(exc, "orig", None) or exc
        first = (str(orig).strip().splitlines() or [""])[0][:200]
        return None, f"{type(orig).__name__}: {first}" if first else type(orig).__name__


def _not_ours(record: logging.LogRecord) -> bool:
    return not record.name.startswith("airflow_nats_ordered")


def _airflow_logs_to_stderr() -> None:
    """Importing Airflow points the root logger at stdout at INFO; a command's stdout is
    its output (``--json``). Its handlers move to stderr, and leave this package's records
    to the CLI's own handler (shown per ``-v``, not twice)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.__stdout__):
            h.setStream(sys.stderr)
            h.addFilter(_not_ours)
