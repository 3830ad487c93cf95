"""The ``nats`` scheme of ``MessageQueueTrigger`` (apache-airflow-providers-common-messaging).

``MessageQueueTrigger(scheme="nats", stream=..., durable=..., subject=..., nats_conn_id=...)``
becomes a :class:`~airflow_nats_ordered.triggers.messages.NatsMessageTrigger` with those
keyword arguments (it serializes as that trigger, so the triggerer runs it directly).
"""

from __future__ import annotations

from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider

from ..triggers.messages import NatsMessageTrigger


class NatsMessageQueueProvider(BaseMessageQueueProvider):
    """Scheme ``nats``: JetStream messages, at least once into asset events."""

    scheme = "nats"

    def trigger_class(self) -> type[NatsMessageTrigger]:
        return NatsMessageTrigger
