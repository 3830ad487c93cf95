"""Airflow hook: NatsHook reads a ``nats`` connection and connects (imports Airflow)."""
