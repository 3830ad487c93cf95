"""``python -m airflow_nats_ordered.demo``: the flights pipeline demo (:mod:`.pipeline`)."""

from __future__ import annotations

import sys

from airflow_nats_ordered.demo.pipeline import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m airflow_nats_ordered.demo"))
