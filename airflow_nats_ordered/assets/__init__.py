"""Airflow asset URI schemes of this provider (``asset-uris`` in the provider info)."""
