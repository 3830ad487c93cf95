"""Claiming a partition's lease so that a cancelled claim leaves nothing held (:func:`claim_lease`).

Guarantees: the claim is bounded (a bucket electing a leader answers nothing; a claim that
timed out is retried next tick, and one the server applied without an answer expires after
the TTL). If the claiming task is cancelled (``Worker.stop()`` while claims are in flight;
a starting member sends all its claims at once), the lease's create may already be on the
wire: its answer is still awaited (at most the bound) and a lease it got is released, so a
member that has left holds no partition the others would have to wait a TTL for. That
clean-up runs to its end even if the task is cancelled again meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib

from airflow_nats_ordered.core.group.leases import Lease
from airflow_nats_ordered.core.group.store import GroupStore

#: clean-ups of cancelled claims (a reference keeps each task alive until it ends)
_RELEASING: set[asyncio.Task[None]] = set()


async def claim_lease(store: GroupStore, key: str, member: str, bound: float) -> Lease | None:
    """``store.acquire(key, member)`` within ``bound`` seconds (TimeoutError after), giving
    back what it got if the caller is cancelled meanwhile (see the module docstring)."""
    acquiring = asyncio.ensure_future(store.acquire(key, member))
    try:
        async with asyncio.timeout(bound):
            return await asyncio.shield(acquiring)
    except TimeoutError:
        acquiring.cancel()  # as an unshielded call would be: nobody waits for its answer
        raise
    except asyncio.CancelledError:
        cleanup = asyncio.ensure_future(_release_when_acquired(store, acquiring, bound))
        _RELEASING.add(cleanup)
        cleanup.add_done_callback(_RELEASING.discard)
        await asyncio.shield(cleanup)
        raise


async def _release_when_acquired(
    store: GroupStore, acquiring: asyncio.Future[Lease | None], bound: float
) -> None:
    """Wait (at most ``bound`` seconds) for a cancelled claim's answer; release its lease."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(bound):
            lease = await acquiring
            if lease is not None:
                await store.release(lease)
