"""The nycflights13 ordered pipeline: what its DAGs share (settings, verification,
re-processing) and the handler the worker pool runs (:mod:`flights.handlers`).

Importable with the dags folder on the path (Airflow puts it there; the pool needs
``PYTHONPATH=dags``)."""
