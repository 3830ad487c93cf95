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
    }
