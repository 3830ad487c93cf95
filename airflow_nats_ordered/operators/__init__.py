"""Airflow operators: provision, publish, Spark publish, group rebalance and reset."""
