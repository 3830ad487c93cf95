"""``python -m airflow_nats_ordered.cli``: the same as the ``nats-ordered`` command."""

import sys

from . import main

sys.exit(main())
