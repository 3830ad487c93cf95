"""The sink's options: read once from Spark's (case-insensitive) option map into one frozen
dataclass, validated on the driver before any task runs.

Connection settings come from the ``NATS_*`` environment variables of the Spark driver (see
:mod:`~airflow_nats_ordered.core.connection.environment`); the non-secret ones can be overridden per
write with options. Secrets (passwords, tokens, creds and nkey files, TLS keys) are refused
as options: Spark shows options in its UI and logs its plans, so they come only from the
driver's environment (or the files it names). The connection is resolved once, when the
options are parsed on the driver, and travels with them (pickled) to the tasks: executors
need no ``NATS_*`` environment, and a variable changed after that is not read by anybody.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_nats_ordered.core.connection.environment import check_files_here, resolve
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError, PermissionDenied, denial_in

#: the Spark option (lower case) -> ConnectionOptions field, for non-secret settings
CONNECTION_OPTIONS: Mapping[str, str] = {
    "url": "servers",
    "servers": "servers",
    "user": "user",
    "tlsca": "tls_ca_file",
    "tlscert": "tls_cert_file",
    "tlshostname": "tls_hostname",
    "tlsverify": "tls_verify",
    "connecttimeout": "connect_timeout",
    "name": "name",
    "reconnecttimewait": "reconnect_time_wait",
    "maxreconnectattempts": "max_reconnect_attempts",
    "pinginterval": "ping_interval",
    "maxoutstandingpings": "max_outstanding_pings",
    "inboxprefix": "inbox_prefix",
    "jsdomain": "js_domain",
    "jsapiprefix": "js_api_prefix",
}
#: Spark option names (as :meth:`SinkOptions.pinned_connection` writes them) of the above
_OPTION_NAME = {
    "servers": "url",
    "user": "user",
    "tls_ca_file": "tlsCa",
    "tls_cert_file": "tlsCert",
    "tls_hostname": "tlsHostname",
    "tls_verify": "tlsVerify",
    "connect_timeout": "connectTimeout",
    "name": "name",
    "reconnect_time_wait": "reconnectTimeWait",
    "max_reconnect_attempts": "maxReconnectAttempts",
    "ping_interval": "pingInterval",
    "max_outstanding_pings": "maxOutstandingPings",
    "inbox_prefix": "inboxPrefix",
    "js_domain": "jsDomain",
    "js_api_prefix": "jsApiPrefix",
}
#: the option that pins the auth method the caller resolved (checked, never a secret)
AUTH_OPTION = "auth"

#: options that would carry a secret (lower case) -> the environment variable to use instead
SECRET_OPTIONS: Mapping[str, str] = {
    "password": "NATS_PASSWORD",
    "token": "NATS_TOKEN",
    "creds": "NATS_CREDS",
    "credsfile": "NATS_CREDS",
    "nkey": "NATS_NKEY",
    "nkeyseed": "NATS_NKEY",
    "nkeyseedfile": "NATS_NKEY",
    "tlskey": "NATS_KEY",
    "tlskeyfile": "NATS_KEY",
}
#: internal: set by write_ordered on a run it carried over a repartition (it passes over
#: what the old layout stored); a direct write of such a run is refused
CARRIED_OVER_OPTION = "carriedover"
_SINK_OPTIONS = (
    "stream",
    "keycolumn",
    "orderby",
    "producerid",
    "msgidcolumn",
    "allowrefused",
    "deliverytimeout",
    AUTH_OPTION,
    CARRIED_OVER_OPTION,
)
#: an auth method -> what gives its user (for error messages)
_VARIABLE_OF = {
    "creds": "creds file given by NATS_CREDS",
    "nkey": "nkey seed given by NATS_NKEY",
    "token": "token given by NATS_TOKEN",
}
#: options Spark itself may pass along with ours
_SPARK_OPTIONS = ("path", "checkpointlocation", "queryname")

#: the routing column :func:`~airflow_nats_ordered.spark.routing.route` adds
PARTITION_COLUMN = "nats_partition"
#: the key column when no ``keyColumn`` option is given (as in Spark's Kafka sink)
DEFAULT_KEY_COLUMN = "key"
#: payload column used as-is when present (string or binary); otherwise the row as JSON
VALUE_COLUMN = "value"
#: optional map<string,string> column of extra message headers
HEADERS_COLUMN = "headers"


def _seconds(name: str, raw: Any) -> float | None:
    if raw is None or str(raw).strip() == "":
        return None
    try:
        value = float(str(raw).strip())
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f'option {name} must be a number of seconds > 0, e.g. .option("{name}", "60"); '
            f"got {raw!r}"
        )
    return value


def _flag(name: str, raw: str | None) -> bool:
    if raw is None:
        return False
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ConfigError(f"option {name} must be true or false, got {raw!r}")


@dataclass(frozen=True)
class SinkOptions:
    """What one write of the ``nats-ordered`` sink does. Picklable.

    ``resolved`` is the connection :meth:`from_spark` read on the driver, secrets included
    (hidden in ``repr()``): it is pickled with the writer to the tasks, which use it as it
    is. It never goes into Spark options, confs, the UI or the logs.
    """

    stream: str
    key_column: str
    producer_id: str
    order_by: tuple[str, ...] = ()
    msg_id_column: str | None = None
    allow_refused: bool = False
    #: publisher delivery timeout (s): how long a task keeps resending before failing
    delivery_timeout: float | None = None
    #: non-secret connection overrides (ConnectionOptions field -> value)
    connection: Mapping[str, str] = field(default_factory=dict)
    #: the auth method the caller resolved (option ``auth``), checked against ``resolved``
    expected_auth: str | None = None
    #: no ``keyColumn`` option was given: the key is the column ``key`` (Kafka's sink)
    key_defaulted: bool = False
    #: write_ordered passed over what an earlier layout stored of the run (internal option)
    carried_over: bool = False
    #: the connection, resolved once by :meth:`from_spark` (see the class docstring)
    resolved: ConnectionOptions | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_spark(
        cls, options: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> SinkOptions:
        """Parse Spark's option map and resolve the connection from ``env`` (default: this
        process's environment) once; a ConfigError names the option or variable to fix."""
        opts = {str(k).lower(): v for k, v in options.items()}
        secrets = sorted(k for k in opts if k in SECRET_OPTIONS)
        if secrets:
            hint = ", ".join(f"{k} -> {SECRET_OPTIONS[k]}" for k in secrets)
            raise ConfigError(
                f"option(s) {', '.join(secrets)} would put a secret where Spark shows and logs "
                f"it; set the environment variable of the driver and executors instead ({hint})"
            )
        unknown = sorted(
            k
            for k in opts
            if k not in _SINK_OPTIONS and k not in CONNECTION_OPTIONS and k not in _SPARK_OPTIONS
        )
        if unknown:
            accepted = ("stream", "keyColumn", "orderBy", "producerId", "msgIdColumn")
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)} for format 'nats-ordered'; accepted: "
                f"{', '.join(accepted)}, allowRefused, deliveryTimeout, auth and the connection "
                f"options {', '.join(sorted(set(CONNECTION_OPTIONS)))}"
            )
        key_defaulted = "keycolumn" not in opts
        if key_defaulted:  # Spark's Kafka sink: the key is the column "key"
            opts["keycolumn"] = DEFAULT_KEY_COLUMN
        for required, example in (
            ("stream", "FLIGHTS"),
            ("keycolumn", "tailnum"),
            ("producerid", "flights.publish.2013-01-01"),
        ):
            if not str(opts.get(required) or "").strip():
                name = {"keycolumn": "keyColumn", "producerid": "producerId"}.get(
                    required, required
                )
                why = (
                    " (name the run: the same input gets the same producer id on every retry "
                    "and re-submit, a different input a new one"
                    + (
                        "; it is given but empty or blank, as an unset variable gives it)"
                        if required in opts
                        else ")"
                    )
                    if required == "producerid"
                    else ""
                )
                raise ConfigError(
                    f"option {name} is required for format 'nats-ordered', e.g. "
                    f'.option("{name}", "{example}"){why}'
                )
        url = str(opts.get("url") or opts.get("servers") or "")
        if "@" in url:
            raise ConfigError(
                "option url carries credentials (user:password@ or token@): Spark shows options "
                "in its UI; put them in NATS_USER/NATS_PASSWORD or NATS_TOKEN instead"
            )
        connection = {
            CONNECTION_OPTIONS[k]: str(v) for k, v in opts.items() if k in CONNECTION_OPTIONS
        }
        timeout = _seconds("deliveryTimeout", opts.get("deliverytimeout"))
        sink = cls(
            stream=str(opts["stream"]).strip(),
            key_column=str(opts["keycolumn"]).strip(),
            producer_id=str(opts["producerid"]).strip(),
            order_by=tuple(
                c.strip() for c in str(opts.get("orderby") or "").split(",") if c.strip()
            ),
            msg_id_column=(str(opts["msgidcolumn"]).strip() or None)
            if opts.get("msgidcolumn")
            else None,
            allow_refused=_flag("allowRefused", opts.get("allowrefused")),
            delivery_timeout=timeout,
            key_defaulted=key_defaulted,
            carried_over=_flag("carriedOver", opts.get(CARRIED_OVER_OPTION)),
            connection=connection,
            expected_auth=str(opts[AUTH_OPTION]).strip() if opts.get(AUTH_OPTION) else None,
        )
        try:
            resolved = resolve(os.environ if env is None else env, sink.connection)
        except ConfigError as exc:
            wrong = str(getattr(exc, "field", ""))
            if wrong in sink.connection:  # an option's value: name the option
                text = str(exc).removeprefix(f"{wrong} ")
                if {"js_domain", "js_api_prefix"} <= sink.connection.keys():
                    text = "jsDomain and jsApiPrefix are both set; give only one of them"
                raise ConfigError(f"option {_OPTION_NAME[wrong]}: {text}") from None
            raise
        if sink.expected_auth is not None and resolved.auth_method != sink.expected_auth:
            raise ConfigError(
                f"the caller connected with NATS auth {sink.expected_auth!r} (option auth) but "
                f"the Spark driver's environment gives {resolved.auth_description()}: the "
                "NATS_* variables the data source reads are those its Spark JVM started with; "
                "set them before the SparkSession starts (or restart it)"
            )
        object.__setattr__(sink, "resolved", resolved)
        return sink

    def denial_in_spark_terms(self, exc: BaseException) -> PermissionDenied | None:
        """A :class:`PermissionDenied` behind ``exc`` worded for the sink: the option (or
        variable) that gave the refused user, and the publisher role it writes as."""
        denied = denial_in(exc)
        if denied is None:
            return None
        conn = self.resolved
        method = conn.auth_method if conn is not None else "none"
        if conn is not None and method == "user/password":
            user = f"the user given by option user (or NATS_USER) {conn.user!r}"
        elif method in _VARIABLE_OF:
            user = f"the user of the {_VARIABLE_OF[method]}"
        else:
            user = (
                "the server's default user (no option user, NATS_USER, NATS_CREDS, "
                "NATS_NKEY or NATS_TOKEN given)"
            )
        return denied.in_terms(
            user,
            "the sink writes as the publisher role: run `nats-ordered permissions --role "
            f"publisher --stream {self.stream}` and grant that user what it prints (or set "
            "option user / the NATS_* variables to a user that has it)",
        )

    def connection_options(self) -> ConnectionOptions:
        """The connection :meth:`from_spark` resolved on the driver, the same in every task
        (never the environment of the moment); a file it names that this host lacks is a
        ConfigError naming its variable."""
        resolved = self.resolved
        if resolved is None:  # built directly, not by from_spark
            resolved = resolve(os.environ, self.connection)
            object.__setattr__(self, "resolved", resolved)
        check_files_here(resolved)
        return resolved

    def pinned_connection(self) -> dict[str, str]:
        """Spark options naming every non-secret setting of the resolved connection and its
        auth method: given to the data source, its driver side uses exactly these servers
        and settings, and refuses a different auth method before anything is sent."""
        conn = self.connection_options()
        out = {AUTH_OPTION: conn.auth_method}
        for name, option in _OPTION_NAME.items():
            value = getattr(conn, name)
            if value is None:
                continue
            if name == "servers":
                out[option] = ",".join(value)
            elif isinstance(value, bool):
                out[option] = str(value).lower()
            else:
                out[option] = str(value)
        return out

    def to_spark(self) -> dict[str, str]:
        """The same settings as Spark options (``df.write.options(**...)``)."""
        out = {
            "stream": self.stream,
            "keyColumn": self.key_column,
            "producerId": self.producer_id,
            "allowRefused": str(self.allow_refused).lower(),
        }
        if self.order_by:
            out["orderBy"] = ",".join(self.order_by)
        if self.msg_id_column:
            out["msgIdColumn"] = self.msg_id_column
        if self.delivery_timeout is not None:
            out["deliveryTimeout"] = str(self.delivery_timeout)
        if self.expected_auth is not None:
            out[AUTH_OPTION] = self.expected_auth
        for name, value in self.connection.items():
            out[_OPTION_NAME[name]] = value
        return out
