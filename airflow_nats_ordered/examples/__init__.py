"""Example handlers for ``nats-ordered worker`` (used by ``make demo``)."""
