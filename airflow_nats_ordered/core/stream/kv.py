"""KV primitives the group's state relies on: leader reads, compact JSON, bucket replicas.

Guarantees: :func:`latest_entry` reads a key from its bucket's stream leader, never from a
possibly stale replica, so a compare-and-set decision is taken on the newest value;
:func:`ensure_replicas` only ever raises a bucket's replica count in place (lowering it on
purpose is refused with the command that does it deliberately).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import ConfigError

log = logging.getLogger(__name__)

#: the header a KV delete or purge marker carries (``DEL``/``PURGE``)
KV_OP = "KV-Operation"


def compact_json(obj: Any) -> bytes:
    """``obj`` as JSON without blanks (the encoding of every value in the group's buckets)."""
    return json.dumps(obj, separators=(",", ":")).encode()


async def latest_entry(nc: NATS, bucket: str, key: str) -> tuple[bytes | None, int] | None:
    """The latest entry of ``key`` read from the bucket's stream leader (never a possibly
    stale replica): ``(value, revision)``, ``(None, revision)`` for a delete or purge
    marker, or None if the key was never written (or its history was purged)."""
    try:
        msg = await jetstream(nc).get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except NotFoundError:
        return None
    op = (msg.headers or {}).get(KV_OP)
    return (None if op in ("DEL", "PURGE") else (msg.data or b"")), int(msg.seq or 0)


async def bucket_keys(nc: NATS, bucket: str, prefix: str = "") -> list[str]:
    """The keys of ``bucket`` (those starting with ``prefix``) that hold a message, as the
    server lists its stream's subjects, sorted; the latest message of one may be a delete or
    purge marker, so read each (``get`` raises KeyDeletedError for those).

    Never nats-py's ``KeyValue.keys()``: it lists through a watcher whose end-of-listing
    marker can be queued before the entries when the bucket is written meanwhile, and then
    returns no keys at all (NoKeysError). Measured against a bucket three keys of which
    were rewritten every millisecond: 14 of 500 ``keys()`` calls came back empty, so a
    group's ``status`` could show no members, commits or blocked partitions, and ``group
    delete`` could find no live member. A stream info lists up to 100,000 subjects (the
    server's page), far more than a group's buckets hold (two keys a partition and one a
    member)."""
    pre = f"$KV.{bucket}."
    try:
        info = await jetstream(nc).stream_info(f"KV_{bucket}", subjects_filter=f"{pre}{prefix}>")
    except NotFoundError:
        return []
    return sorted(s[len(pre) :] for s in (info.state.subjects or {}) if s.startswith(pre + prefix))


async def ensure_replicas(nc: NATS, bucket: str, replicas: int, *, explicit: bool) -> None:
    """Raise an existing bucket to ``replicas`` in place; never lower it. A member that
    asks for fewer on purpose (``explicit``) is refused: one member's setting must not take
    the whole group's state down to fewer copies."""
    js = jetstream(nc)
    info = await js.stream_info(f"KV_{bucket}")
    current = info.config.num_replicas or 1
    if current > replicas and explicit:
        raise ConfigError(
            f"the group's KV bucket {bucket} has {current} replicas but {replicas} were "
            f"requested (state_replicas, CLI --state-replicas): a member never lowers the "
            f"group's state for every member; drop the setting, or lower the bucket "
            f"deliberately (`nats stream edit KV_{bucket} --replicas {replicas}`)"
        )
    if current >= replicas:
        return
    info.config.num_replicas = replicas
    await js.update_stream(info.config)
    log.info("KV bucket %s now has %d replicas", bucket, replicas)
