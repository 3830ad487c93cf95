"""Airflow triggers of the provider (importing this package imports Airflow)."""
