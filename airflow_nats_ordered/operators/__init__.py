"""Airflow operators: provision, repartition, publish, Spark publish, group rebalance and reset."""
