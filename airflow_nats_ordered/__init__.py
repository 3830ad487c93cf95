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
            {
                "schemes": ["nats"],
                "handler": "airflow_nats_ordered.assets.nats.sanitize_uri",
                "to_openlineage_converter": (
                    "airflow_nats_ordered.operators.lineage.convert_asset_to_openlineage"
                ),
            }
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


def _field(
    label: str,
    description: str,
    kind: str = "string",
    *,
    secret: bool = False,
    **more: object,
) -> dict:
    """One field of the connection form: ``description`` is the help text Airflow's form
    shows under it (``conn-fields`` ``<name>.description``, served by the API's hook meta)."""
    schema: dict = {"type": [kind, "null"]}
    if secret:
        # hides the form widget only; the REST API, the UI and logs hide an extra by its
        # NAME (a sensitive word such as secret/private_key/token, see
        # hooks/connection_secrets.py), which every secret field's name below contains
        schema["format"] = "password"
    schema.update(more)
    return {"label": label, "description": description, "schema": schema}


_CONTENT = "Content is written to a file only the Airflow user can read; give this or {path}."
_PATH = "It must exist on every machine that runs the tasks and the triggerer. Or give {content}."

#: the ``nats`` connection form (extras): exactly the extras ``hooks.nats.options_from_connection``
#: reads (tests/airflow/test_airflow_connection_form.py keeps the two and docs/airflow.md equal)
_CONN_FIELDS = {
    "servers": _field(
        "Servers (comma list of URLs, instead of Host/Port)",
        "nats://a:4222,tls://b:4222: give these or Host/Port, not both. No user:password@ or "
        "token@ in a URL (refused: Airflow shows this field in clear); use the fields below.",
    ),
    "token": _field(
        "Token", "Token authentication. Hidden in the UI, the REST API and logs.", secret=True
    ),
    "creds_secret": _field(
        "Credentials (.creds file content)",
        "The whole .creds file (JWT and nkey seed) for decentralised (operator/account) "
        "authentication. Hidden. " + _CONTENT.format(path="Credentials file path"),
        secret=True,
    ),
    "creds_file": _field(
        "Credentials file path (.creds)",
        "Path of a .creds file. " + _PATH.format(content="Credentials (content)"),
    ),
    "nkey_seed_secret": _field(
        "NKey seed",
        "An nkey user seed (SU...) for nkey authentication. Hidden. "
        + _CONTENT.format(path="NKey seed file path"),
        secret=True,
    ),
    "nkey_seed_file": _field(
        "NKey seed file path",
        "Path of a file holding an nkey user seed. " + _PATH.format(content="NKey seed"),
    ),
    "tls_ca": _field(
        "TLS CA certificate (PEM content)",
        "The CA that signed the server's certificate, PEM. "
        + _CONTENT.format(path="TLS CA certificate file path"),
    ),
    "tls_ca_file": _field(
        "TLS CA certificate file path",
        "Path of the CA certificate (PEM). " + _PATH.format(content="its content"),
    ),
    "tls_cert": _field(
        "TLS client certificate (PEM content)",
        "The client certificate for TLS client authentication, PEM (with TLS client key). "
        + _CONTENT.format(path="TLS client certificate file path"),
    ),
    "tls_cert_file": _field(
        "TLS client certificate file path",
        "Path of the client certificate (PEM). " + _PATH.format(content="its content"),
    ),
    "tls_private_key": _field(
        "TLS client key (PEM content)",
        "The client certificate's private key, PEM. Hidden. "
        + _CONTENT.format(path="TLS client key file path"),
        secret=True,
    ),
    "tls_key_file": _field(
        "TLS client key file path",
        "Path of the client certificate's private key (PEM). "
        + _PATH.format(content="its content"),
    ),
    "tls_hostname": _field(
        "TLS server name (if not the host)",
        "The name the server's certificate is verified against, when it is not the host "
        "connected to (e.g. connecting by IP address).",
    ),
    "tls_verify": _field(
        "Verify the server certificate",
        "Uncheck only for a test server: the connection is then encrypted but not "
        "authenticated. Default: checked.",
        "boolean",
        default=True,
    ),
    "connect_timeout": _field(
        "Connect timeout (seconds)",
        "How long to wait for each server when connecting. Default 5.",
        "number",
        default=5,
    ),
    "name": _field(
        "Client name (shown by the server's monitoring)",
        "The name nats-server's monitoring (connz) shows for this client. Default nats-ordered.",
        default="nats-ordered",
    ),
    "max_reconnect_attempts": _field(
        "Reconnect attempts per server (-1 forever, 0 never)",
        "After a connection is lost: attempts per server before giving up (-1 forever, "
        "0 never). Default 120: with the wait below, about a minute of downtime is ridden out.",
        "integer",
        default=120,
    ),
    "reconnect_time_wait": _field(
        "Wait between reconnect attempts (seconds)",
        "Seconds between two reconnect attempts to the same server. Default 0.5.",
        "number",
        default=0.5,
    ),
    "inbox_prefix": _field(
        "Inbox prefix (instead of _INBOX)",
        "The prefix of the client's reply subjects, for a user whose permissions allow "
        "subscribing only to <prefix>.> (e.g. _INBOX_ORDERS). Default _INBOX.",
    ),
    "js_domain": _field(
        "JetStream domain",
        "The JetStream domain the streams and the group's state live in, e.g. a leaf node's "
        "(requests go to $JS.<domain>.API). Empty: the account's own JetStream. Not with "
        "JetStream API prefix.",
    ),
    "js_api_prefix": _field(
        "JetStream API prefix (instead of $JS.API)",
        "The subject prefix of the JetStream API, when it is imported from another account "
        "under a prefix. Not with JetStream domain.",
    ),
}
