"""The ``NATS_*`` environment of a Spark driver: every connection setting, resolved once.

Lives in the core (not in :mod:`airflow_nats_ordered.spark`) so that the Airflow operator
that writes this environment does not import pyspark.

Where the settings come from
    The environment of the Spark *driver* (in client mode: the ``spark-submit`` process, or
    the JVM a ``SparkSession`` started), in the ``NATS_*`` variables of :data:`SPARK_ENV_VARS`:
    the ``nats`` CLI's nine (``NATS_URL``, ``NATS_USER``, ``NATS_PASSWORD``, ``NATS_TOKEN``,
    ``NATS_CREDS``, ``NATS_NKEY``, ``NATS_CA``, ``NATS_CERT``, ``NATS_KEY``), those named
    after its ``--inbox-prefix``, ``--js-domain`` and ``--js-api-prefix`` flags
    (``NATS_INBOX_PREFIX``, ``NATS_JS_DOMAIN``, ``NATS_JS_API_PREFIX``) and one for each
    other :class:`~.connect.ConnectionOptions` field
    (``NATS_NKEY_SEED``, ``NATS_TLS_HOSTNAME``, ``NATS_TLS_VERIFY``, ``NATS_CONNECT_TIMEOUT``,
    ``NATS_NAME``, ``NATS_RECONNECT_TIME_WAIT``, ``NATS_MAX_RECONNECT_ATTEMPTS``,
    ``NATS_PING_INTERVAL``, ``NATS_MAX_OUTSTANDING_PINGS``), then the sink's non-secret
    options over them. :func:`spark_env` is the inverse: the variables that give a driver
    exactly a given :class:`ConnectionOptions` (``NatsSparkPublishOperator`` sets them).

Guarantees
    * :func:`resolve` reads the environment once; the result is what the driver's ledger
      reads and every task's writes use (it travels to the tasks inside the pickled writer,
      so executors need no ``NATS_*`` environment and a variable changed later is not read).
    * Files the settings name (creds, nkey seed, CA, certificate, key) are read where the
      connection is opened: on a cluster they must exist at the same path on every
      executor host; :func:`check_files_here` says so, naming the variable, before a task
      connects.
    * Errors name the environment variable (or option) to fix and never show a secret.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from airflow_nats_ordered.core.connection.fields import ENV_VARS
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError

#: the variables beyond the ``nats`` CLI's -> ConnectionOptions field
EXTRA_ENV_VARS: Mapping[str, str] = {
    "NATS_NKEY_SEED": "nkey_seed",
    "NATS_TLS_HOSTNAME": "tls_hostname",
    "NATS_TLS_VERIFY": "tls_verify",
    "NATS_CONNECT_TIMEOUT": "connect_timeout",
    "NATS_NAME": "name",
    "NATS_RECONNECT_TIME_WAIT": "reconnect_time_wait",
    "NATS_MAX_RECONNECT_ATTEMPTS": "max_reconnect_attempts",
    "NATS_PING_INTERVAL": "ping_interval",
    "NATS_MAX_OUTSTANDING_PINGS": "max_outstanding_pings",
}
#: every variable a Spark driver reads -> ConnectionOptions field (one per field)
SPARK_ENV_VARS: Mapping[str, str] = {**ENV_VARS, **EXTRA_ENV_VARS}
ENV_OF_FIELD: Mapping[str, str] = {field: var for var, field in SPARK_ENV_VARS.items()}
#: the auth fields; a Spark option for one of them replaces the environment's auth method
_AUTH_FIELDS = ("user", "password", "token", "creds_file", "nkey_seed_file", "nkey_seed")
_FILE_FIELDS = ("creds_file", "nkey_seed_file", "tls_ca_file", "tls_cert_file", "tls_key_file")


def resolve(
    env: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> ConnectionOptions:
    """The connection described by ``env`` (see :data:`SPARK_ENV_VARS`), with ``overrides``
    (ConnectionOptions fields, e.g. from Spark options) applied over it.

    An override of an auth field replaces every auth method taken from the environment, and
    one of ``js_domain``/``js_api_prefix`` replaces both (as
    :meth:`ConnectionOptions.from_env` does). A ConfigError names the variable or option.
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for var, name in SPARK_ENV_VARS.items():
        raw = env.get(var)
        if raw is not None and raw.strip() != "":
            values[name] = raw
            source[name] = var
    if given.keys() & set(_AUTH_FIELDS):
        chosen = given.keys() & set(_AUTH_FIELDS)
        keep = {"user", "password"} if chosen & {"user", "password"} else chosen
        for name in _AUTH_FIELDS:
            if name not in keep:
                values.pop(name, None)
                source.pop(name, None)
    if given.keys() & {"js_domain", "js_api_prefix"}:  # an option for one replaces both
        for name in ("js_domain", "js_api_prefix"):
            values.pop(name, None)
            source.pop(name, None)
    if "nkey_seed" in values and "nkey_seed_file" in values:
        raise ConfigError(
            "both NATS_NKEY_SEED (the seed) and NATS_NKEY (a seed file) are set; unset one"
        )
    for name in given:
        source.pop(name, None)
    values.update(given)
    try:
        return ConnectionOptions.from_mapping(values)
    except ConfigError as exc:
        wrong = getattr(exc, "field", None)
        if wrong in source:
            raise ConfigError(
                f"{exc} (from environment variable {source[wrong]} of the Spark driver)"
            ) from None
        raise


def spark_env(options: ConnectionOptions) -> dict[str, str]:
    """The ``NATS_*`` variables that make :func:`resolve` give back ``options``: every set
    field, secrets included (an environment, never a command line or a Spark conf)."""
    env: dict[str, str] = {}
    for name in ConnectionOptions.FIELDS:
        value = getattr(options, name)
        if value is None:
            continue
        if name == "servers":
            text = ",".join(value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value) if not isinstance(value, float) else repr(value)
        env[ENV_OF_FIELD[name]] = text
    return env


def check_files_here(options: ConnectionOptions) -> None:
    """Refuse, naming the variable, a file the connection names that this host lacks (a
    Spark executor on another host than the driver: the files must be at the same path on
    every executor host)."""
    for name in _FILE_FIELDS:
        path = getattr(options, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(
                f"{name} {path!r} (environment variable {ENV_OF_FIELD[name]} of the Spark "
                f"driver) does not exist on host {socket.gethostname()!r}: a Spark task opens "
                "its own NATS connection, so every file the connection names must exist at "
                "the same path on every executor host (install or mount it there)"
            )


__all__ = ["EXTRA_ENV_VARS", "SPARK_ENV_VARS", "check_files_here", "resolve", "spark_env"]
