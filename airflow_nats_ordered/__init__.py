"""airflow-nats-ordered: Kafka-like per-key ordered event pipelines on NATS JetStream.

Importing this package imports neither Airflow nor Spark; the asyncio core lives in
:mod:`airflow_nats_ordered.core`.
"""

from __future__ import annotations

__version__ = "0.1.0"

DISTRIBUTION = "airflow-nats-ordered"


def get_provider_info() -> dict:
    """Airflow provider metadata (entry point ``apache_airflow_provider``).

    ``package-name`` equals the distribution name, as Airflow's ProvidersManager expects.
    Hooks, operators, sensors, triggers, the ``nats`` connection type and the ``nats``
    queue are added here as they arrive.
    """
    return {
        "package-name": DISTRIBUTION,
        "name": "NATS JetStream (ordered)",
        "description": (
            "Kafka-like per-key ordered event pipelines on NATS JetStream: partitioned "
            "streams, an ordered idempotent publisher, lease-owning worker pools."
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "NATS JetStream",
                "external-doc-url": "https://docs.nats.io/nats-concepts/jetstream",
                "tags": ["service"],
            }
        ],
        "hooks": [
            {
                "integration-name": "NATS JetStream",
                "python-modules": ["airflow_nats_ordered.hooks.nats"],
            }
        ],
        "operators": [
            {
                "integration-name": "NATS JetStream",
                "python-modules": [
                    "airflow_nats_ordered.operators.streams",
                    "airflow_nats_ordered.operators.publish",
                    "airflow_nats_ordered.operators.group",
                    "airflow_nats_ordered.operators.spark",
                ],
            }
        ],
        "sensors": [
            {
                "integration-name": "NATS JetStream",
                "python-modules": ["airflow_nats_ordered.sensors.drain"],
            }
        ],
        "triggers": [
            {
                "integration-name": "NATS JetStream",
                "python-modules": [
                    "airflow_nats_ordered.triggers.drain",
                    "airflow_nats_ordered.triggers.messages",
                ],
            }
        ],
        "queues": ["airflow_nats_ordered.queues.nats.NatsMessageQueueProvider"],
        # the UI view (Browse > NATS pipelines); also the `airflow.plugins` entry point,
        # which Airflow loads whatever [core] lazy_discover_providers says
        "plugins": [
            {
                "name": "nats_ordered",
                "plugin-class": "airflow_nats_ordered.plugins.view.NatsOrderedViewPlugin",
            }
        ],
        "asset-uris": [
            {"schemes": ["nats"], "handler": "airflow_nats_ordered.assets.nats.sanitize_uri"}
        ],
        "connection-types": [
            {
                "connection-type": "nats",
                "hook-class-name": "airflow_nats_ordered.hooks.nats.NatsHook",
                "hook-name": "NATS JetStream",
                "conn-fields": _CONN_FIELDS,
                "ui-field-behaviour": {
                    "hidden-fields": ["schema"],
                    "relabeling": {"login": "User"},
                    "placeholders": {
                        "host": "nats-1:4222,nats-2:4222 (or nats://..., tls://...)",
                        "port": "4222",
                        "login": "user (for user/password authentication)",
                    },
                },
            }
        ],
    }


def _field(label: str, kind: str = "string", *, secret: bool = False, **more: object) -> dict:
    schema: dict = {"type": [kind, "null"]}
    if secret:
        # hides the form widget only; the REST API, the UI and logs hide an extra by its
        # NAME (a sensitive word such as secret/private_key/token, see
        # hooks/connection_secrets.py), which every secret field's name below contains
        schema["format"] = "password"
    schema.update(more)
    return {"label": label, "schema": schema}


#: the ``nats`` connection form (extras): exactly the extras ``hooks.nats.options_from_connection``
#: reads (tests/airflow/test_airflow_connection_form.py keeps the two and docs/airflow.md equal)
_CONN_FIELDS = {
    "servers": _field("Servers (comma list of URLs, instead of Host/Port)"),
    "token": _field("Token", secret=True),
    "creds_secret": _field("Credentials (.creds file content)", secret=True),
    "creds_file": _field("Credentials file path (.creds)"),
    "nkey_seed_secret": _field("NKey seed", secret=True),
    "nkey_seed_file": _field("NKey seed file path"),
    "tls_ca": _field("TLS CA certificate (PEM content)"),
    "tls_ca_file": _field("TLS CA certificate file path"),
    "tls_cert": _field("TLS client certificate (PEM content)"),
    "tls_cert_file": _field("TLS client certificate file path"),
    "tls_private_key": _field("TLS client key (PEM content)", secret=True),
    "tls_key_file": _field("TLS client key file path"),
    "tls_hostname": _field("TLS server name (if not the host)"),
    "tls_verify": _field("Verify the server certificate", "boolean", default=True),
    "connect_timeout": _field("Connect timeout (seconds)", "number", default=5),
    "name": _field("Client name (shown by the server's monitoring)", default="nats-ordered"),
    "max_reconnect_attempts": _field(
        "Reconnect attempts per server (-1 forever, 0 never)", "integer", default=120
    ),
    "reconnect_time_wait": _field(
        "Wait between reconnect attempts (seconds)", "number", default=0.5
    ),
}
