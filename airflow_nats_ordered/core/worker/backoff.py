"""When a partition whose claim failed is claimed again (:class:`ClaimBackoff`).

A claim that fails for a reason that is not a blip (a contended token, a missing commit
record, a re-created stream, ``on_assign`` or ``fencing_floor`` failing), or a partition
handed back because the handler's ``applied_position`` hook failed, is claimed again only
after a delay that doubles with each failure, from ``max(tick, retry_backoff)`` up to
``BACKOFF_MAX``; until a claim succeeds the member reports why in its problems
(``claim.<partition>``). Written by the reconcile loop (:mod:`.reconcile`) and by delivery
(:mod:`.delivery`), forgotten at an epoch switch (:mod:`.epochs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from airflow_nats_ordered.core.worker.config import BACKOFF_MAX, WorkerConfig


class ClaimBackoff:
    """The back-off of each partition whose claim failed (see the module)."""

    def __init__(self, cfg: WorkerConfig, report: Callable[[str, str | None], None]) -> None:
        self._cfg = cfg
        self._report = report
        #: partition -> (monotonic time before which it is not claimed, last delay)
        self._until: dict[int, tuple[float, float]] = {}

    def waiting(self, p: int) -> bool:
        """``p`` is not to be claimed yet."""
        return time.monotonic() < self._until.get(p, (0.0, 0.0))[0]

    def failed(self, p: int, problem: str) -> None:
        """Claim ``p`` again only after a delay that doubles with each failure, up to
        ``BACKOFF_MAX``; report ``problem`` until a claim succeeds."""
        delay = self._until.get(p, (0.0, 0.0))[1] * 2
        delay = min(BACKOFF_MAX, max(self._cfg.tick, self._cfg.retry_backoff, delay))
        self._until[p] = (time.monotonic() + delay, delay)
        self._report(f"claim.{p}", f"partition {p}: {problem}; retrying in {delay:.1f}s")

    def claimed(self, p: int) -> None:
        """``p`` was claimed: no back-off, no problem."""
        self._until.pop(p, None)
        self._report(f"claim.{p}", None)

    def clear(self) -> None:
        self._until.clear()
