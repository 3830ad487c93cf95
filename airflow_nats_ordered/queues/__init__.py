"""Message-queue providers for ``apache-airflow-providers-common-messaging``."""
