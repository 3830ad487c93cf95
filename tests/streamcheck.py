"""Read a whole stream back and check the publisher's invariants over it.

Used by the publisher and fault tests: everything that was published is compared with
everything that is stored, per partition and per key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats import errors as nats_errors
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import ServiceUnavailableError

from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.partitioning import partition_for

_T = TypeVar("_T")
# what the JetStream API answers while a stream or meta leader is being elected
_NOT_YET = (nats_errors.TimeoutError, nats_errors.NoRespondersError, ServiceUnavailableError)


@dataclass(frozen=True)
class Stored:
    seq: int
    subject: str
    msg_id: str
    key: str
    data: bytes
    #: its ``Nats-Global-Seq`` header (publish --global-order), None without one
    global_seq: int | None = None


async def read_stream(
    nc: NATS, stream: str, batch: int = 2000, patience: float = 30.0
) -> list[Stored]:
    """Every message of ``stream`` in stream order, read with a pull consumer.

    Right after a fault (a killed stream or meta leader) the JetStream API may not answer
    for a few seconds while leaders are elected: each API call is retried for up to
    ``patience`` seconds, so a slow election is not mistaken for a publisher failure.
    """
    js = nc.jetstream()
    deadline = time.monotonic() + patience

    async def retried(call: Callable[[], Awaitable[_T]]) -> _T:
        while True:
            try:
                return await call()
            except (
                nats_errors.TimeoutError,
                nats_errors.NoRespondersError,
                ServiceUnavailableError,
            ):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    info = await retried(lambda: js.stream_info(stream))
    total = info.state.messages
    out: list[Stored] = []
    if total == 0:
        return out

    def consumer(start: int) -> Awaitable[Any]:
        # ack-none: nothing limits how many messages one fetch may carry. An ephemeral
        # consumer is deleted after its inactive threshold (5 s by default): a reader slowed
        # down by a loaded machine got 503 / a timeout from its next fetch (seen in a loaded
        # CI run), so the threshold is long, and a consumer gone anyway is made again from
        # the next sequence, not read from the start
        return js.pull_subscribe(
            ">",
            stream=stream,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=300.0,
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start,
            ),
        )

    sub = await retried(lambda: consumer(1))
    try:
        while len(out) < total:
            try:
                msgs = await sub.fetch(min(batch, total - len(out)), timeout=10)
            except (
                nats_errors.TimeoutError,
                nats_errors.NoRespondersError,
                ServiceUnavailableError,
            ):
                if time.monotonic() > deadline + 60:
                    raise
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                after = out[-1].seq + 1 if out else 1
                sub = await retried(lambda after=after: consumer(after))
                continue
            for m in msgs:
                h = m.headers or {}
                out.append(
                    Stored(
                        m.metadata.sequence.stream,
                        m.subject,
                        h.get("Nats-Msg-Id", ""),
                        message_key(h) or "",
                        m.data,
                        int(h["Nats-Global-Seq"]) if "Nats-Global-Seq" in h else None,
                    )
                )
    finally:
        with contextlib.suppress(Exception):
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


def _describe(body: bytes) -> str:
    """A short name for a record in messages: its key and per-key index when it has them."""
    try:
        rec = json.loads(body)
        return f"{rec['k']}#{rec['i']}"
    except (ValueError, KeyError, TypeError):
        return repr(body[:40])


def stored_problems(
    records: list[tuple[str, bytes]],
    stored: list[Stored],
    partitions: int,
    prefix: str,
    acked: dict[int, int] | None = None,
    limit: int = 10,
) -> list[str]:
    """Every way ``stored`` breaks the publisher's invariants, each named precisely.

    * no record is stored twice (by msg-id and by content);
    * each partition holds a gap-free prefix of its input, in input order (so every key
      is in publish order): the first position where it differs is named, with what was
      expected and what was stored there;
    * with ``acked``: the first ``acked[p]`` records of partition p are all stored (the
      missing acknowledged records are named).
    """
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    seen_bodies: dict[bytes, int] = {}
    for s in stored:
        if s.msg_id in seen_ids:
            problems.append(
                f"msg-id {s.msg_id} is stored twice (seq {seen_ids[s.msg_id]}, {s.seq})"
            )
        seen_ids.setdefault(s.msg_id, s.seq)
        if s.data in seen_bodies:
            problems.append(
                f"record {_describe(s.data)} is stored twice (seq {seen_bodies[s.data]}, {s.seq})"
            )
        seen_bodies.setdefault(s.data, s.seq)

    want: dict[int, list[bytes]] = defaultdict(list)
    for k, body in records:
        want[partition_for(k, partitions)].append(body)
    got: dict[int, list[Stored]] = defaultdict(list)
    for s in stored:
        p = int(s.subject.rsplit(".", 1)[1])
        if s.subject != f"{prefix}.p.{p}":
            problems.append(f"seq {s.seq} is on subject {s.subject}, not {prefix}.p.{p}")
        got[p].append(s)
    for p in range(partitions):
        g, w = got.get(p, []), want.get(p, [])
        for i, s in enumerate(g):
            if i >= len(w) or s.data != w[i]:
                expected = _describe(w[i]) if i < len(w) else "nothing (input exhausted)"
                later = [j for j in range(i, len(g)) if i < len(w) and g[j].data == w[i]]
                where = f"; it is stored later at seq {g[later[0]].seq}" if later else ""
                problems.append(
                    f"partition {p} is not a prefix of its input (order broken): position "
                    f"{i + 1} (seq {s.seq}) holds {_describe(s.data)}, expected {expected}{where}"
                )
                break
        if acked is not None and len(g) < acked.get(p, 0):
            missing = [_describe(b) for b in w[len(g) : acked[p]]]
            problems.append(
                f"partition {p}: {acked[p] - len(g)} acknowledged record(s) missing: "
                f"stored {len(g)}, acked {acked[p]}; first missing: {', '.join(missing[:5])}"
            )
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems


def check_stored(
    records: list[tuple[str, bytes]],
    stored: list[Stored],
    partitions: int,
    prefix: str,
    acked: dict[int, int] | None = None,
) -> dict[int, int]:
    """Assert the invariants of :func:`stored_problems`; return the stored count per partition."""
    problems = stored_problems(records, stored, partitions, prefix, acked)
    assert not problems, "\n".join(problems)
    counts = dict.fromkeys(range(partitions), 0)
    for s in stored:
        counts[int(s.subject.rsplit(".", 1)[1])] += 1
    return counts
