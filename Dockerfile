# The provider and its `nats-ordered` command (the nats server itself is the official image).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY airflow_nats_ordered ./airflow_nats_ordered
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT []
CMD ["nats-ordered", "--help"]
