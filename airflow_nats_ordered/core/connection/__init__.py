"""Connecting to NATS: the options a connection takes, the fields and environment variables
that carry them (Airflow connection, CLI, Spark driver), credentials, and ``connect()``.

Depends on nothing else of the core but :mod:`..errors`.
"""
