"""Finding a server's consumer groups and summing each one up (Kafka's
``kafka-consumer-groups.sh --list`` and ``--describe --all-groups``).

Guarantees: every group that has state (its state bucket ``nor_<stream>_<group>_state``)
is found, with the stream it belongs to read from the bucket itself (its description, else
its ``stream`` record), never guessed from the bucket name alone: a stream ``A`` with group
``b_c`` and a stream ``A_b`` with group ``c`` have the same bucket name and are told apart.
A summary is read with plain gets, like ``status``, and never used to decide ownership.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, NotFoundError

from airflow_nats_ordered.core.admin.dlq import dead_letters
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError
from airflow_nats_ordered.core.connection.api import jetstream, stream_infos
from airflow_nats_ordered.core.errors import StreamNotFoundError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.lag import read_group_lag
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.kv import latest_entry
from airflow_nats_ordered.core.stream.partitioned import describe

#: the description :meth:`..group.store.GroupStore.open` gives a group's state bucket
_DESCRIPTION = re.compile(r"^nats-ordered commits of group (\S+) on (\S+)$")


@dataclass(frozen=True)
class GroupRef:
    """A group that has state: its stream and name."""

    stream: str
    group: str


@dataclass(frozen=True)
class GroupSummary:
    """One line of ``group list``: members, lag, dead letters and what needs an operator."""

    stream: str
    group: str
    members: list[str]
    partitions: int
    owned: int
    total_lag: int
    drained: bool
    blocked: list[int]
    dead_letters: int
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def find_groups(nc: NATS, stream: str | None = None) -> list[GroupRef]:
    """Every group with state on the server (or of ``stream``), sorted by stream and name."""
    found: list[GroupRef] = []
    async for info in stream_infos(nc):
        name = info.config.name or ""
        if not (name.startswith("KV_nor_") and name.endswith("_state")):
            continue
        ref = await _group_of(nc, name[3:], info.config.description or "")
        if ref is not None and (stream is None or ref.stream == stream):
            found.append(ref)
    return sorted(set(found), key=lambda r: (r.stream, r.group))


async def _group_of(nc: NATS, bucket: str, description: str) -> GroupRef | None:
    """The stream and group of state bucket ``bucket`` (``nor_<stream>_<group>_state``)."""
    m = _DESCRIPTION.match(description)
    if m and bucket == f"nor_{m.group(2)}_{m.group(1)}_state":
        return GroupRef(m.group(2), m.group(1))
    try:  # no description: the stream the group recorded
        entry = await latest_entry(nc, bucket, "stream")
    except NotFoundError:
        return None
    if entry is None or entry[0] is None:
        return None
    stream = json.loads(entry[0]).get("name") or ""
    head, tail = f"nor_{stream}_", "_state"
    if not stream or not bucket.startswith(head) or len(bucket) <= len(head) + len(tail):
        return None
    return GroupRef(stream, bucket[len(head) : -len(tail)])


async def require_group(nc: NATS, stream: str, group: str) -> None:
    """Raise GroupNotFoundError, naming the stream's groups, unless ``group`` has state."""
    try:
        await jetstream(nc).key_value(GroupConfig(stream, group).state_bucket)
        return
    except (BucketNotFoundError, NotFoundError):
        pass
    known = [r.group for r in await find_groups(nc, stream)]
    raise GroupNotFoundError(
        f"group {group} of stream {stream} does not exist (no worker has joined it); groups "
        f"of {stream}: {', '.join(known) or 'none'}",
        stream,
        group,
    )


async def summarize_group(nc: NATS, ref: GroupRef) -> GroupSummary:
    """Members, lag, blocked partitions, dead letters and problems of one group. A group
    whose stream is gone is summed up from its state alone, the stream's absence a problem."""
    store = await GroupStore.attach(nc, ref.stream, ref.group)
    snap = await store.snapshot()
    problems = list(snap.problems)
    for p, reason in sorted(snap.blocked.items()):
        if not any(reason in known for known in problems):
            problems.append(f"partition {p} is blocked: {reason}")
    dlq = await dead_letters(nc, ref.stream, ref.group)
    try:
        described = await describe(nc, ref.stream)
        # a repartitioned stream: the layout the group processes, and what later ones hold
        lag = await read_group_lag(nc, described, store, snap)
    except StreamNotFoundError:
        return GroupSummary(
            ref.stream,
            ref.group,
            sorted(snap.members),
            0,
            len(snap.leases),
            0,
            False,
            sorted(snap.blocked),
            dlq.messages,
            problems,
        )
    if lag.strays and lag.strays.problem() not in problems:
        problems.append(lag.strays.problem())
    # a running global-order reader reads (owns) every partition of its group
    owned = len(lag.partitions) if snap.global_reader is not None else len(snap.leases)
    return GroupSummary(
        ref.stream,
        ref.group,
        sorted(snap.members),
        len(lag.partitions),
        owned,
        lag.total_lag,
        lag.drained,
        sorted(p.partition for p in lag.partitions if p.blocked),
        dlq.messages,
        problems,
    )
