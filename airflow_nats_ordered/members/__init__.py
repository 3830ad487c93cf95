"""What a group member process runs around the core's worker: the handler it loads by name
(:mod:`.handlers`; ``nats-ordered worker``, ``pool`` and ``global-read``) and its Prometheus
metrics and health endpoint (:mod:`.metrics`; ``worker`` and ``pool``).
"""
