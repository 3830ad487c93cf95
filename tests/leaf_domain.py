"""A hub and a leaf node on loopback, the leaf's JetStream in its own domain: the config
blocks and the wait until a client of the hub reaches the leaf's JetStream, shared by the
JetStream-domain tests (connection settings, least privilege)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats


def jetstream_block(store: Path, domain: str) -> str:
    """A server's ``jetstream {}`` block in ``domain``, storing under ``store/js``."""
    return f"jetstream {{\n  store_dir: {json.dumps(str(store / 'js'))}\n  domain: {domain}\n}}\n"


def wait_linked(hub_url: str, domain: str, timeout: float, **connect_kwargs: Any) -> None:
    """Until a client of the hub (connected with ``connect_kwargs``: a user, say) gets an
    answer from the JetStream of ``domain``; fails after ``timeout`` seconds."""

    async def main() -> None:
        nc = await nats.connect(hub_url, **connect_kwargs)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        info = await nc.jetstream(domain=domain, timeout=0.5).account_info()
                        if info.domain == domain:
                            return
                    except Exception:  # noqa: BLE001 - not linked yet
                        pass
                    await asyncio.sleep(0.1)
        finally:
            await nc.close()

    asyncio.run(main())
