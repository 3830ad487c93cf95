"""The demos, one module each; they run from a source checkout (they use its ``dags/``).

* ``python -m airflow_nats_ordered.demo`` (or ``.demo.pipeline``; ``make demo``):
  ``flights_ordered_pipeline`` through a real Airflow, Spark and worker pool;
* ``python -m airflow_nats_ordered.demo.cli``: the older CLI-only demo (publish the year,
  three workers, one SIGKILLed, verify).
"""
