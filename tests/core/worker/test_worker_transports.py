"""A member over ``ws://`` and over TLS, with a server restart mid-backlog (issue 19 item 2
review: the commit write is written to the socket by the project where the connection is a
plain or TLS socket, and goes through nats-py's publish and flusher on a websocket, 9c66397;
deliveries take the reader's own route from the socket on every transport, b1c93f2).

Same checks as tests/core/worker/test_worker_commit_outages.py: every record handled, per key in
order,
each partition's commit record at its last message after the restart, no two grants at once.
Needs the optional ``aiohttp`` for ``ws://`` (nats-py's websocket transport)."""

from __future__ import annotations

import asyncio
import ssl

import authfixtures as af
import pytest
from test_worker_commit_outages import _check, _run

from airflow_nats_ordered.embedded.process import free_port
from airflow_nats_ordered.embedded.servers import NatsServer


def test_a_member_over_a_websocket_survives_a_server_restart(tmp_path, unique_name):
    pytest.importorskip("aiohttp")
    port = free_port()
    websocket = f'websocket {{\n  listen: "127.0.0.1:{port}"\n  no_tls: true\n}}\n'
    with NatsServer(tmp_path / "nats", extra_config=websocket, name="ws-server") as server:

        async def restart() -> None:
            await asyncio.to_thread(server.restart)

        h, committed, _ = asyncio.run(_run(f"ws://127.0.0.1:{port}", unique_name, restart))
    _check(h, 1440, committed)


def test_a_member_over_tls_survives_a_server_restart(tmp_path, unique_name):
    pki = af.make_pki(tmp_path / "pki")
    tls_block = pki.server_tls_block(verify=False)
    with NatsServer(tmp_path / "nats", extra_config=tls_block, name="tls-server") as server:

        async def restart() -> None:
            await asyncio.to_thread(server.restart)

        ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
        url = server.url.replace("nats://", "tls://")
        h, committed, _ = asyncio.run(_run(url, unique_name, restart, tls=ctx))
    _check(h, 1440, committed)
