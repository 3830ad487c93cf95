"""A small in-process pool of group members, for tests, notebooks and embedding.

Each member gets its own connection, exactly as separate ``nats-ordered worker`` processes
would, so the pool exercises the same protocol: leases, fencing, cooperative rebalancing.
``add()`` is a join and ``remove()`` a graceful leave; ``stop()`` leaves with everyone.

    async with WorkerPool(ConnectionOptions(servers=("nats://127.0.0.1:4222",)),
                          WorkerConfig("ORDERS", "billing"), handle, size=3) as pool:
        await pool.add()          # a fourth member joins; only its share moves
        await pool.remove()       # the newest member commits, releases and leaves
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.stream.message import BatchHandler, Handler
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker


class WorkerPool:
    """``size`` members of ``config.group`` named ``<config.member_id>-<n>``."""

    def __init__(
        self,
        connection: ConnectionOptions | str,
        config: WorkerConfig,
        handler: Handler | BatchHandler,
        *,
        size: int = 1,
        **worker_kwargs: Any,
    ) -> None:
        if isinstance(connection, str):
            connection = ConnectionOptions(servers=(connection,))
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"pool size must be an integer >= 0, got {size!r}")
        self.connection = connection
        self.config = config
        self.handler = handler
        self.size = size
        self.worker_kwargs = worker_kwargs
        self.workers: list[Worker] = []
        self._all: list[Worker] = []
        self._conns: dict[str, NATS] = {}
        self._next = 1

    @property
    def members(self) -> list[str]:
        return [w.member for w in self.workers]

    @property
    def stats(self) -> dict[str, int]:
        """The counters of every member this pool ran (including those that left), summed."""
        total: dict[str, int] = {}
        for w in self._all:
            for k, v in w.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    async def wait_assigned(self, timeout: float | None = None) -> None:
        """Return once every partition of the stream is claimed by a member of this pool
        and every member has claimed all that the current assignment gives it (see
        :meth:`Worker.wait_assigned`). Raises TimeoutError after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while not self._all_claimed():
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise TimeoutError(
                f"the pool's members have not claimed every partition after {timeout:g}s: "
                + "; ".join(
                    f"{w.member} assigned {sorted(w.assigned)} claimed {sorted(w.claimed)}"
                    + (f" problems {sorted(w.problems.values())}" if w.problems else "")
                    for w in self.workers
                )
            ) from None

    def _all_claimed(self) -> bool:
        if not self.workers:
            return False
        claimed = [w.claimed for w in self.workers]
        every = set().union(*claimed)
        partitions = self.workers[0].stream.partitions
        return every == set(range(partitions)) and all(
            w.assigned <= c for w, c in zip(self.workers, claimed, strict=True)
        )

    async def start(self) -> None:
        for _ in range(self.size - len(self.workers)):
            await self.add()

    async def add(self) -> Worker:
        """Start one more member (a join)."""
        member = f"{self.config.member_id}-{self._next}"
        self._next += 1
        nc = await connect(replace(self.connection, name=f"nats-ordered {member}"))
        try:
            w = Worker(
                nc, replace(self.config, member_id=member), self.handler, **self.worker_kwargs
            )
            await w.start()
        except BaseException:
            await nc.close()
            raise
        self.workers.append(w)
        self._all.append(w)
        self._conns[member] = nc
        return w

    async def remove(self, member: str | None = None) -> None:
        """Stop one member gracefully (the newest if ``member`` is None): it finishes the
        message in hand, commits, releases its partitions and leaves."""
        if not self.workers:
            raise ConfigError("the pool has no members to remove")
        w = self.workers[-1] if member is None else self._find(member)
        try:
            await w.stop()
        finally:
            self.workers.remove(w)
            with contextlib.suppress(Exception):
                await self._conns.pop(w.member).close()

    def _find(self, member: str) -> Worker:
        for w in self.workers:
            if w.member == member:
                return w
        raise ConfigError(f"no member {member!r} in this pool; members: {self.members}")

    async def stop(self) -> None:
        """All members leave (concurrently, so hand-overs do not wait on each other)."""
        workers, self.workers = self.workers, []
        try:
            await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        finally:
            for w in workers:
                nc = self._conns.pop(w.member)
                with contextlib.suppress(Exception):
                    await asyncio.shield(nc.close())

    async def __aenter__(self) -> WorkerPool:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
