"""The sink's options: read once from Spark's (case-insensitive) option map into one frozen
dataclass, validated on the driver before any task runs.

Connection settings come from the ``NATS_*`` environment variables (as the CLI reads them,
:meth:`ConnectionOptions.from_env`); the non-secret ones can be overridden per write with
options. Secrets (passwords, tokens, creds and nkey files, TLS keys) are refused as options:
Spark shows options in its UI and logs its plans, so they come only from the environment
(or the files it names) of the driver and the executors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.connection import ConnectionOptions
from ..core.errors import ConfigError

#: the Spark option (lower case) -> ConnectionOptions field, for non-secret settings
CONNECTION_OPTIONS: Mapping[str, str] = {
    "url": "servers",
    "servers": "servers",
    "user": "user",
    "tlsca": "tls_ca_file",
    "tlscert": "tls_cert_file",
    "tlshostname": "tls_hostname",
    "connecttimeout": "connect_timeout",
    "name": "name",
}
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
_SINK_OPTIONS = (
    "stream",
    "keycolumn",
    "orderby",
    "producerid",
    "msgidcolumn",
    "allowrefused",
    "deliverytimeout",
)
#: options Spark itself may pass along with ours
_SPARK_OPTIONS = ("path", "checkpointlocation", "queryname")

#: the routing column :func:`~airflow_nats_ordered.spark.routing.route` adds
PARTITION_COLUMN = "nats_partition"
#: payload column used as-is when present (string or binary); otherwise the row as JSON
VALUE_COLUMN = "value"
#: optional map<string,string> column of extra message headers
HEADERS_COLUMN = "headers"


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
    """What one write of the ``nats-ordered`` sink does. Picklable; holds no secret."""

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

    @classmethod
    def from_spark(cls, options: Mapping[str, Any]) -> SinkOptions:
        """Parse Spark's option map; a ConfigError names the option to fix."""
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
                f"{', '.join(accepted)}, allowRefused, deliveryTimeout and the connection "
                f"options {', '.join(sorted(set(CONNECTION_OPTIONS)))}"
            )
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
        timeout = opts.get("deliverytimeout")
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
            delivery_timeout=float(timeout) if timeout not in (None, "") else None,
            connection=connection,
        )
        sink.connection_options()  # validate now, on the driver, with a clear message
        return sink

    def connection_options(self) -> ConnectionOptions:
        """The NATS_* environment of this process, with the non-secret overrides applied."""
        return ConnectionOptions.from_env(os.environ, **dict(self.connection))

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
        back = {v: k for k, v in CONNECTION_OPTIONS.items() if k != "servers"}
        for name, value in self.connection.items():
            out[back[name]] = value
        return out
