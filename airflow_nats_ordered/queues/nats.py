"""The ``nats`` scheme of ``MessageQueueTrigger`` (apache-airflow-providers-common-messaging).

``MessageQueueTrigger(scheme="nats", stream=..., subject=..., nats_conn_id=...)`` becomes a
:class:`~airflow_nats_ordered.triggers.messages.NatsMessageTrigger` with those keyword
arguments (it serializes as that trigger, so the triggerer runs it directly); an unknown
argument is refused with the valid ones. Without ``durable=`` every watcher reads its own
durable consumer and gets every message, on any number of triggerers; an explicit
``durable=`` is bound to one trigger's arguments (see that module's docstring). A stream
not created yet or servers out of reach are waited for (one WARNING, then backoff up to
30 s); a bad configuration fails the trigger with what to fix.
"""

from __future__ import annotations

from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider

from airflow_nats_ordered.triggers.messages import NatsMessageTrigger


class NatsMessageQueueProvider(BaseMessageQueueProvider):
    """Scheme ``nats``: JetStream messages, at least once into asset events."""

    scheme = "nats"

    def trigger_class(self) -> type[NatsMessageTrigger]:
        return NatsMessageTrigger
