"""The provider's Airflow UI plugin: a view of the pipelines inside Airflow's UI.

:mod:`.view` holds the :class:`~airflow.plugins_manager.AirflowPlugin` Airflow loads (from
the ``airflow.plugins`` entry point and the provider info's ``plugins``); :mod:`.app` the
FastAPI app it mounts under ``/nats-ordered``: the page and the JSON it reads. Importing
this package imports nothing of Airflow's.
"""
