"""Re-process the pipeline from a day on, on purpose (a handler fix, a corrected sink).

Re-running a day never re-applies anything by itself (the run ledger publishes nothing
twice, the fenced sink applies each message once). To apply days again:

1. pause ``flights_ordered_pipeline`` and let the running day drain (nothing is published
   while the sink and the group are rewound);
2. :func:`reprocess_from` ``day``: the sink forgets the flights from ``day`` on and rewinds
   its fences (:func:`flights.handlers.rewind_sink`), then the group's positions are reset
   to just before ``day`` in each partition involved
   (:func:`airflow_nats_ordered.core.admin.reset.reset_group`, fenced: a running member
   cannot write an old position back), so the pool applies those days again, in order;
3. clear the runs from ``day`` on (``airflow tasks clear flights_ordered_pipeline -s <day>
   -y``) and unpause: each day publishes nothing (its run is complete in the ledger), waits
   for the drain and verifies the totals against the Spark reference again.
"""

from __future__ import annotations

from typing import Any

from airflow_nats_ordered.core.admin.reset import reset_group
from airflow_nats_ordered.hooks.nats import NatsHook
from flights.handlers import rewind_sink
from flights.settings import FlightsSettings


def reprocess_from(day: str, settings: FlightsSettings) -> dict[str, Any]:
    """Rewind the sink to the start of ``day`` (``YYYY-MM-DD``), then the group to match.

    Returns ``{"positions": {partition: sequence}}`` (the group's new positions: the last
    sequence kept per partition) and the reset's result. The sink goes first: a group
    rewound before it would re-deliver messages the sink still takes for re-deliveries.
    """
    kept = rewind_sink(settings.sink_path(), stream=settings.stream, group=settings.group, day=day)
    if not kept:
        return {"positions": {}, "reset": None}

    async def reset(nc: Any) -> dict[str, Any]:
        done = await reset_group(nc, settings.stream, settings.group, to=kept, confirm=True)
        return done.to_dict()

    return {
        "positions": {str(p): s for p, s in kept.items()},
        "reset": NatsHook(settings.nats_conn_id).run(reset),
    }
