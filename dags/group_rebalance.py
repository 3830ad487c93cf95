"""Airflow DAG ``group_rebalance``: every hour, rebalance the flights worker group by measured
load (message rates per partition over the last hour), skipped when the gain is under 10 %.
See :func:`flights.operations.rebalance_dag`."""

from flights.operations import rebalance_dag

dag = rebalance_dag()
