"""Example DAG: publish with a PySpark job through NatsSparkPublishOperator, as one named run.

Needs Spark besides NATS, so the system test only parses this file (tests/system/utils.py,
``get_parse_test``); the operator runs for real in tests/airflow/test_spark_operator.py and in the
flights pipeline (dags/flights_ordered_pipeline.py, dags/flights/pipeline.py, ``make
demo``). docs/howto/spark-publish.md quotes the marked part.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG

from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator

ENV_ID = os.environ.get("SYSTEM_TESTS_ENV_ID", "local")
DAG_ID = "example_nats_spark_publish"
STREAM = f"EXAMPLE_SPARK_{ENV_ID}"

with DAG(
    dag_id=DAG_ID,
    schedule="@daily",
    start_date=datetime(2024, 1, 1),
    tags=["example", "nats", "spark"],
) as dag:
    # [START howto_operator_nats_spark_publish]
    publish = NatsSparkPublishOperator(
        task_id="publish",
        application="spark_apps/publish_flights.py",  # publishes with the nats-ordered sink
        application_args=["--start", "{{ ds }}"],  # --stream and --producer-id are appended
        stream=STREAM,
        conn_id="spark_default",  # a local or spark:// master, client deploy mode
        nats_conn_id="nats_default",  # reaches the driver as NATS_* environment variables
        conf={"spark.sql.shuffle.partitions": "4"},
    )
    # [END howto_operator_nats_spark_publish]


from system.utils import get_parse_test  # noqa: E402

# pytest parses it (docs/howto/index.md: system tests)
test_parse = get_parse_test(dag)
