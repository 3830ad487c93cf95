"""``publish_run`` in a process of its own, so that the nemesis can kill it.

``python -m explore.publish_run_child SERVERS STREAM PRODUCER_ID FILE [--global-order]``:
publishes the JSON lines of FILE (key field ``k``) as the run PRODUCER_ID (with
``--global-order``: stamped with the stream's global sequence, ``GlobalOrder()``) and prints
the run's record (JSON).
Exit 0 when the run is complete, 1 when partial, 3 on an error. It connects as
``$NATS_USER`` with ``$NATS_PASSWORD`` when set (the explorer's ``--least-privilege``: the
publisher), through the core's ``connect`` (a refused permission fails at once with
PermissionDenied, which it prints).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass

from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.runs import publish_run


@dataclass
class Row:
    key: str
    payload: bytes
    where: str
    msg_id: str | None = None


async def main(
    servers: str, stream: str, producer_id: str, path: str, global_order: bool = False
) -> int:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                body = json.dumps(d, separators=(",", ":")).encode()
                rows.append(Row(d["k"], body, f"{path}:{n}"))
    options = ConnectionOptions(
        servers=tuple(servers.split(",")),
        user=os.environ.get("NATS_USER") or None,
        password=os.environ.get("NATS_PASSWORD") or None,
        max_reconnect_attempts=-1,
    )
    nc = await connect(options)
    try:
        result = await publish_run(
            nc,
            stream,
            rows,
            producer_id=producer_id,
            config=PublisherConfig(
                ack_timeout=2.0,
                delivery_timeout=30.0,
                global_order=GlobalOrder() if global_order else None,
            ),
        )
    finally:
        await nc.close()
    print(json.dumps(result.to_dict()))
    return 0 if result.record.status == "complete" else 1


if __name__ == "__main__":
    servers, stream, producer_id, path = sys.argv[1:5]
    global_order = "--global-order" in sys.argv[5:]
    sys.exit(asyncio.run(main(servers, stream, producer_id, path, global_order)))
