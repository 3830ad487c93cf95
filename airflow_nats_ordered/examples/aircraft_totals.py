"""Moved beside the DAGs: the per-aircraft running totals handler is ``dags/flights/handlers.py``
(``--handler flights.handlers:AircraftTotals`` with the dags folder on ``PYTHONPATH``).

This old path keeps working in a source checkout (the repository's ``dags`` folder is put on
the path when ``flights`` is not importable)::

    --handler airflow_nats_ordered.examples.aircraft_totals:AircraftTotals
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import flights.handlers as _handlers
except ImportError:
    sys.path.append(str(Path(__file__).resolve().parents[2] / "dags"))
    import flights.handlers as _handlers

AircraftTotals = _handlers.AircraftTotals
DDL = _handlers.DDL

__all__ = ["DDL", "AircraftTotals"]
