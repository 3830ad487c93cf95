"""Example DAGs of the provider, run as Airflow runs its providers' system tests."""
