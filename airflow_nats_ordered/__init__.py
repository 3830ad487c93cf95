"""airflow-nats-ordered."""
