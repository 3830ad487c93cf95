"""Asyncio core over nats-py: partitioning, provisioning, publishing, leases, workers.

Nothing here imports Airflow or Spark, so the core runs on a Spark executor or in a plain
worker container.
"""
