"""Each partition's last stored message, and whether it is a given run's.

A run resumed after an attempt that died before recording its progress reads how far
each partition got from the partition's last message: the run's records are stored in
position order within a partition, so positions 1..n are stored when the last message is
the run's n-th (its ``Nats-Ordered-Producer`` is the run's producer id, its
``Nats-Ordered-Seq`` is n). A partition where another producer published after the run
shows only the stream sequence (the fence of the next attempt), not a position.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.publish.msg_ids import HDR_MSG_ID, HDR_PRODUCER, HDR_SEQ
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream


@dataclass(frozen=True)
class StoredTail:
    """A partition's last message: its stream sequence, and when it is the run's own, its
    position in the run (``Nats-Ordered-Seq``) and msg-id (else 0 and "")."""

    seq: int
    position: int = 0
    msg_id: str = ""


async def read_tails(
    nc: NATS, stream: PartitionedStream, producer_id: str
) -> dict[int, StoredTail]:
    """Per partition of ``stream``'s layout that holds messages, its last one (direct
    gets, all partitions at once); ``producer_id`` says which messages are the run's."""
    js = jetstream(nc)
    out: dict[int, StoredTail] = {}

    async def tail(p: int) -> None:
        try:
            msg = await js.get_last_msg(stream.name, stream.subject(p), direct=True)
        except NotFoundError:
            return
        h = msg.headers or {}
        seq = h.get(HDR_SEQ, "")
        if h.get(HDR_PRODUCER) == producer_id and seq.isdigit():
            out[p] = StoredTail(int(msg.seq or 0), int(seq), h.get(HDR_MSG_ID, ""))
        elif msg.seq:
            out[p] = StoredTail(int(msg.seq))

    await asyncio.gather(*(tail(p) for p in range(stream.partitions)))
    return out
