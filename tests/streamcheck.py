"""Read a whole stream back and check the publisher's invariants over it.

Used by the publisher and fault tests: everything that was published is compared with
everything that is stored, per partition and per key.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api

from airflow_nats_ordered.core.partitioning import partition_for


@dataclass(frozen=True)
class Stored:
    seq: int
    subject: str
    msg_id: str
    key: str
    data: bytes


async def read_stream(nc: NATS, stream: str, batch: int = 2000) -> list[Stored]:
    """Every message of ``stream`` in stream order, read with a pull consumer."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    total = info.state.messages
    out: list[Stored] = []
    if total == 0:
        return out
    # ack-none: nothing limits how many messages one fetch may carry
    sub = await js.pull_subscribe(
        ">", stream=stream, config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE)
    )
    try:
        while len(out) < total:
            msgs = await sub.fetch(min(batch, total - len(out)), timeout=10)
            for m in msgs:
                h = m.headers or {}
                out.append(
                    Stored(
                        m.metadata.sequence.stream,
                        m.subject,
                        h.get("Nats-Msg-Id", ""),
                        h.get("Nats-Ordered-Key", ""),
                        m.data,
                    )
                )
    finally:
        await sub.unsubscribe()
    out.sort(key=lambda s: s.seq)
    return out


def write_jsonl(path: Path, rows: Any) -> Path:
    """Write ``rows`` (dicts) as JSON lines; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_records(n: int, keys: int, size: int = 100) -> list[tuple[str, bytes]]:
    """``n`` records over ``keys`` keys; each payload names its key and per-key index."""
    per_key: dict[str, int] = defaultdict(int)
    out = []
    for g in range(n):
        k = f"key-{(g * 7919) % keys}"
        body = json.dumps({"k": k, "i": per_key[k], "g": g}).encode()
        per_key[k] += 1
        out.append((k, body.ljust(size, b" ")))
    return out


def check_stored(
    records: list[tuple[str, bytes]],
    stored: list[Stored],
    partitions: int,
    prefix: str,
    acked: dict[int, int] | None = None,
) -> dict[int, int]:
    """Assert the invariants; return the stored count per partition.

    * no record is stored twice (by msg-id and by content);
    * each partition holds a gap-free prefix of its input, in input order (so every key
      is in publish order);
    * with ``acked``: the first ``acked[p]`` records of partition p are all stored.
    """
    ids = [s.msg_id for s in stored]
    assert len(ids) == len(set(ids)), "a msg-id is stored twice"
    bodies = [s.data for s in stored]
    assert len(bodies) == len(set(bodies)), "a record is stored twice"

    want: dict[int, list[bytes]] = defaultdict(list)
    for k, body in records:
        want[partition_for(k, partitions)].append(body)
    got: dict[int, list[bytes]] = defaultdict(list)
    for s in stored:
        p = int(s.subject.rsplit(".", 1)[1])
        assert s.subject == f"{prefix}.p.{p}"
        got[p].append(s.data)
    counts = {}
    for p in range(partitions):
        g, w = got.get(p, []), want.get(p, [])
        assert g == w[: len(g)], f"partition {p} is not a prefix of its input (order broken)"
        if acked is not None:
            assert len(g) >= acked.get(p, 0), f"partition {p}: an acknowledged record is missing"
        counts[p] = len(g)
    return counts
