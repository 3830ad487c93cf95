"""How far behind a consumer group is: the one definition of *lag*, used by ``status``,
``group list``, the ``_lag`` metrics, ``group reset``'s plan and the drain sensor.

A partition's lag is the number of records stored on its subject with a stream sequence
above the group's committed position (``c.<n>`` in the group's state bucket; for a
global-order reader's group, the partition's sequence in the reader's position). It is
exact: the server counts the subject's records after the position
(:func:`records_after`), because stream sequences are shared by every partition and
``last - committed`` counts the other partitions' records published in between.

A group still on an earlier layout epoch of a repartitioned stream lags by the records of
its own layout after its positions plus every record of the later layouts (it finishes its
own layout before reading any of them): :attr:`GroupLag.later`.

Records the stream's limits removed (``max_msgs``, ``max_bytes``, ``max_age``) before the
group processed them are not counted: no worker can process them any more, so a committed
position below the stream's first sequence lags by the records still stored.

Cost: nothing beyond the stream read of ``status`` for a partition that is caught up or
has committed nothing (its lag is 0, or all its records); one batch direct get
(``$JS.API.DIRECT.GET``, read-only, answered by any replica) for each other partition,
all sent at once. See docs/protocol.md section 9.2.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from nats.aio.client import Client as NATS

from airflow_nats_ordered.core.connection.api import api_subject
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.status import GroupState
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import (
    PartitionedStream,
    PartitionStats,
    partition_stats,
    stream_contents,
)
from airflow_nats_ordered.core.stream.strays import Strays

#: seconds one count may take (a request the server answers from its subject index)
COUNT_TIMEOUT = 10.0


async def records_after(nc: NATS, stream: str, subject: str, seq: int) -> int:
    """The number of records stored on ``subject`` of ``stream`` with a sequence above
    ``seq``, counted by the server: one batch direct get of the first such record, whose
    ``Nats-Num-Pending`` header says how many more match (nats-server >= 2.11, a stream
    with ``allow_direct``, as every provisioned stream has). A ``seq`` below the stream's
    first sequence counts every stored record of the subject."""
    req = {"seq": seq + 1, "next_by_subj": subject, "batch": 1}
    msg = await nc.request(
        api_subject(nc, f"DIRECT.GET.{stream}"), json.dumps(req).encode(), timeout=COUNT_TIMEOUT
    )
    headers = msg.headers or {}
    status = headers.get("Status")
    if status == "404":  # no record after seq
        return 0
    pending = headers.get("Nats-Num-Pending")
    if status or pending is None:
        why = headers.get("Description") or status or "no Nats-Num-Pending header"
        raise NatsOrderedError(
            f"counting the records of {subject} in stream {stream} after sequence {seq} "
            f"failed: {why}. The count needs nats-server 2.11 or later and direct gets "
            f"allowed on the stream (`nats-ordered provision --stream {stream} ...` sets it)"
        )
    return int(pending) + 1  # the record returned and those after it


@dataclass(frozen=True)
class PartitionLag:
    """One partition: last stream sequence, committed position, records stored, the lag
    (records after the committed position) and the blocked reason."""

    partition: int
    last: int
    committed: int
    messages: int
    lag: int
    blocked: str | None = None


@dataclass(frozen=True)
class GroupLag:
    """A group's lag over all partitions; ``drained`` when no partition is behind and the
    stream holds no stray messages (which no worker ever reads)."""

    stream: str
    group: str
    partitions: tuple[PartitionLag, ...]
    strays: Strays | None = None
    #: the layout epoch the group processes, the stream's current epoch, the records of
    #: layouts after the group's (none processed yet), the epoch ``partitions`` are of
    #: (their commits count only when it is the group's) and the stream's last switch point
    #: (0 unless repartitioned: a mark at or below it is of an earlier layout)
    epoch: int = 0
    stream_epoch: int = 0
    later: int = 0
    stats_epoch: int = 0
    switch_seq: int = 0
    #: the epoch of a layout whose switch point is not recorded yet (a repartition running
    #: or interrupted), else None: see :attr:`drained`
    pending_switch: int | None = None

    @property
    def switch_unfinished(self) -> bool:
        """A layout the group has not passed has no recorded switch point yet."""
        return self.pending_switch is not None and self.pending_switch >= self.epoch

    @property
    def total_lag(self) -> int:
        """Records the group has still to process: every partition's lag and the later
        layouts' records."""
        return sum(p.lag for p in self.partitions) + self.later

    @property
    def drained(self) -> bool:
        """Nothing left to process, and nothing can still arrive on a layout the group has
        not finished: never while the switch point of the group's layout (or a later one)
        is pending, since records of it may still be stored and the group cannot move on."""
        return (
            not self.strays
            and not self.switch_unfinished
            and not self.later
            and self.stats_epoch == self.epoch
            and all(p.committed >= p.last for p in self.partitions)
        )


def committed_positions(
    stats: Sequence[PartitionStats], state: GroupState, layout_epoch: int | None = None
) -> dict[int, int]:
    """Each partition's committed position in ``state`` (0: none), for ``stats`` of layout
    ``layout_epoch`` (default: the stream's current one). The commits are of the layout
    the group processes: for another layout none of them counts."""
    stats_epoch = state.stream_epoch if layout_epoch is None else layout_epoch
    if stats_epoch != state.epoch:
        return {s.partition: 0 for s in stats}
    gp = state.global_position
    out = {}
    for s in stats:
        c = state.commits.get(s.partition)
        # a global-order reader's group: its position holds the partitions' sequences
        global_seq = gp.seqs.get(s.partition, 0) if gp is not None else 0
        out[s.partition] = c.seq if c is not None else global_seq
    return out


def needs_count(stat: PartitionStats, committed: int) -> bool:
    """Whether a partition's lag needs :func:`records_after`: it has committed something
    and is short of its last record (else its lag is 0, or all its records)."""
    return 0 < committed < stat.last_seq


def group_lag(
    stream: str,
    group: str,
    stats: Sequence[PartitionStats],
    state: GroupState,
    strays: Strays | None = None,
    *,
    layout_epoch: int | None = None,
    after: Mapping[int, int] | None = None,
) -> GroupLag:
    """The lag of ``group`` from already-read partition stats, a group snapshot, the
    stream's strays and ``after``: for each partition that :func:`needs_count`, the
    records after its committed position (:func:`records_after`; ValueError if one is
    missing). :func:`read_group_lag` reads them all.

    ``stats`` are of layout ``layout_epoch`` (default: the stream's current one). The
    snapshot's commits are of the layout the group processes; when that is another (a
    repartitioned stream whose group has not switched yet) none of them counts for
    ``stats`` and the result is not drained."""
    stats_epoch = state.stream_epoch if layout_epoch is None else layout_epoch
    mine = stats_epoch == state.epoch
    committed = committed_positions(stats, state, layout_epoch)
    counted = after or {}
    parts = []
    for s in stats:
        c = committed[s.partition]
        if c >= s.last_seq:
            n = 0
        elif c == 0:
            n = s.messages
        elif s.partition in counted:
            n = counted[s.partition]
        else:
            raise ValueError(
                f"partition {s.partition} committed {c} of {s.last_seq}: its lag needs the "
                "server's count of its records after that position (records_after)"
            )
        parts.append(
            PartitionLag(
                s.partition,
                s.last_seq,
                c,
                s.messages,
                n,
                state.blocked.get(s.partition) if mine else None,
            )
        )
    return GroupLag(
        stream,
        group,
        tuple(parts),
        strays,
        epoch=state.epoch,
        stream_epoch=state.stream_epoch,
        stats_epoch=stats_epoch,
        switch_seq=state.switch_seq,
        pending_switch=state.pending_switch,
    )


async def count_after(
    nc: NATS, stream: PartitionedStream, positions: Mapping[int, int]
) -> dict[int, int]:
    """:func:`records_after` for each ``partition -> position`` of ``stream``'s layout,
    the requests sent at once."""
    found = await asyncio.gather(
        *(records_after(nc, stream.name, stream.subject(p), seq) for p, seq in positions.items())
    )
    return dict(zip(positions, found, strict=True))


async def later_messages(nc: NATS, described: PartitionedStream, epoch: int) -> int:
    """Records the stream holds in layouts after ``epoch`` (a group at ``epoch`` has
    processed none of them: it finishes its own layout first)."""
    later = 0
    for e in range(epoch + 1, described.current_epoch + 1):
        later += sum(s.messages for s in await partition_stats(nc, described.at_epoch(e)))
    return later


async def read_group_lag(
    nc: NATS, described: PartitionedStream, store: GroupStore, state: GroupState
) -> GroupLag:
    """A group's lag now: the partitions of the layout the group processes (``store``'s
    epoch) against ``state`` (its snapshot), the later layouts' records and the stream's
    strays. The one reading of lag behind ``status``, ``group list``, the metrics and the
    drain sensor."""
    mine = described.at_epoch(store.epoch)
    contents = await stream_contents(nc, mine)
    later = await later_messages(nc, described, store.epoch)
    committed = committed_positions(contents.partitions, state, store.epoch)
    wanted = {
        s.partition: committed[s.partition]
        for s in contents.partitions
        if needs_count(s, committed[s.partition])
    }
    found = group_lag(
        described.name,
        store.cfg.group,
        contents.partitions,
        state,
        contents.strays,
        layout_epoch=store.epoch,
        after=await count_after(nc, mine, wanted),
    )
    pending = described.pending_switch
    return replace(found, later=later, pending_switch=None if pending is None else pending.epoch)
