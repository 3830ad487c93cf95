"""Whether a consumer group exists and who is alive in it.

A group exists once its first member has created its two KV buckets,
``nor_<stream>_<group>_leases`` and ``nor_<stream>_<group>_state`` (see :mod:`..group.store`),
and until ``group delete`` removes them. Its live members are those whose heartbeat
(``m.<id>`` in the lease bucket) has not expired, plus a running global-order reader of the
group (its heartbeat, key ``global``). Each check is a read, never used to decide
ownership: a drain wait, a delete, a reset or a rebalance use it to refuse or to report.
:class:`GroupNotFoundError` is the error of an operation on a group that does not exist.
"""

from __future__ import annotations

import json

from nats.aio.client import Client as NATS
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    NotFoundError,
)

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.global_position import READER_KEY
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.kv import bucket_keys


class GroupNotFoundError(NatsOrderedError):
    """Neither of the group's buckets exists (and, when they were to be purged, it has no
    dead letters). ``dead_letters_kept`` counts the group's dead letters left in place
    because purging them was not asked for, so a caller can word the fix in its own terms
    (the Python API's ``dead_letters=True``, the CLI's ``--dead-letters``)."""

    def __init__(self, message: str, stream: str, group: str, dead_letters_kept: int = 0) -> None:
        super().__init__(message)
        self.stream = stream
        self.group = group
        self.dead_letters_kept = dead_letters_kept


async def group_exists(nc: NATS, stream: str, group: str) -> bool:
    """Whether the group has state: its buckets exist (the first member to join creates
    them, and only ``group delete`` removes them)."""
    js = jetstream(nc)
    cfg = GroupConfig(stream, group)
    try:
        await js.key_value(cfg.lease_bucket)
        await js.key_value(cfg.state_bucket)
    except (BucketNotFoundError, NotFoundError):
        return False
    return True


async def live_members(nc: NATS, stream: str, group: str) -> list[str]:
    """Members whose heartbeat (``m.<id>`` in the lease bucket) has not expired, and a
    running global-order reader of the group (its heartbeat, key ``global``), so a drain's
    no-members check and ``group delete`` see it too."""
    bucket = GroupConfig(stream, group).lease_bucket
    try:
        kv = await jetstream(nc).key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        return []
    members = []
    for key in await bucket_keys(nc, bucket, "m."):
        try:
            await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue  # left (deleted) or expired meanwhile
        members.append(key[2:])
    try:
        reader = await kv.get(READER_KEY)
    except (KeyNotFoundError, KeyDeletedError):
        return members
    member = json.loads(reader.value or b"{}").get("member") or "global-order reader"
    return [*members, str(member)]


async def reader_alive(store: GroupStore) -> bool:
    """Whether a global-order reader of the group is running (its heartbeat, key
    ``global`` of the lease bucket, has not expired)."""
    try:
        await store.leases.get(READER_KEY)
    except (KeyNotFoundError, KeyDeletedError):
        return False
    return True
