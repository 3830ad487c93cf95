"""``python -m airflow_nats_ordered.cli``: the same as the ``nats-ordered`` command."""

import sys

from airflow_nats_ordered.cli import main

sys.exit(main())
