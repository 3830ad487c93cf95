"""The JSON an operator reads about a server's pipelines: one group's status (what
``nats-ordered status --json`` prints), the group list (``group list --json``), the
partitioned streams with their layout epochs, a stream's run ledger and its global
producers, and where a drain wait on given marks stands (the drain sensor's, shown per
DAG run by the view). The CLI and the Airflow UI view (``airflow_nats_ordered.plugins``) both print
these dicts, so the two cannot disagree.

Everything here reads with plain gets and never decides ownership.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.admin.dlq import dead_letters
from airflow_nats_ordered.core.admin.listing import find_groups, summarize_group
from airflow_nats_ordered.core.admin.marks import marks_to_wait, recorded_switch
from airflow_nats_ordered.core.admin.membership import group_exists
from airflow_nats_ordered.core.connection.api import stream_infos
from airflow_nats_ordered.core.errors import NatsOrderedError, StreamNotFoundError
from airflow_nats_ordered.core.group.assignor import Assignment
from airflow_nats_ordered.core.group.global_position import GlobalPosition
from airflow_nats_ordered.core.group.lag import count_after, read_group_lag
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.order.producers import list_producers, show_time
from airflow_nats_ordered.core.publish.runs import RunRecord, ledger_bucket
from airflow_nats_ordered.core.stream.kv import bucket_keys, latest_entry
from airflow_nats_ordered.core.stream.layout import pending_switch_problem
from airflow_nats_ordered.core.stream.partitioned import META_PARTITIONS, describe
from airflow_nats_ordered.core.stream.strays import Strays


async def group_status(nc: NATS, stream_name: str, group: str) -> dict[str, Any]:
    """A group's status as a JSON-safe dict (``nats-ordered status --json``): per partition
    its owner, fencing token, committed position, last sequence, exact lag and whether it is
    blocked; the members and their heartbeat age; dead letters, strays, problems and the
    global-order reader's position."""
    stream = await describe(nc, stream_name)
    store = await GroupStore.attach(nc, stream_name, group)
    snap = await store.snapshot()
    # a repartitioned stream: the partitions of the layout epoch the group is at, and the
    # records of the later layouts (counted in the lag)
    lag = await read_group_lag(nc, stream, store, snap)
    later = lag.later
    dlq = await dead_letters(nc, stream_name, group)
    strays = lag.strays if lag.strays is not None else Strays(stream.name, stream.partitions)
    generation = None
    if snap.assignment:
        generation = Assignment.from_json(snap.assignment).generation
    now = time.time()
    gp, reader = snap.global_position, snap.global_reader
    # a global-order reader (one member reading every partition) owns them all while alive
    reader_id = str(reader.get("member") or "") or None if reader else None
    parts: list[dict[str, Any]] = []
    for p in lag.partitions:
        c = snap.commits.get(p.partition)
        owner = snap.leases.get(p.partition, (None, 0))[0]
        token = c.token if c else 0
        if c is None and gp is not None:
            owner, token = reader_id, gp.token
        parts.append(
            {
                "partition": p.partition,
                "owner": owner,
                "fencing_token": token,
                "committed": p.committed,
                "last": p.last,
                "lag": p.lag,
                "blocked": p.blocked,
            }
        )
    members = [
        {
            "member": m,
            "host": info.get("host"),
            "pid": info.get("pid"),
            "partitions": sorted(p["partition"] for p in parts if p["owner"] == m),
            "heartbeat_age": round(max(0.0, now - float(info.get("ts", now))), 3),
        }
        for m, info in sorted(snap.members.items())
    ]
    return {
        "stream": stream.name,
        "group": group,
        "generation": generation,
        "leader": snap.leader,
        "total_lag": lag.total_lag,
        "drained": lag.drained,
        "epoch": store.epoch,
        "stream_epoch": stream.current_epoch,
        "later_layout_messages": later,
        "partitions": parts,
        "members": members,
        "dead_letters": {
            "stream": dlq.stream,
            "subjects": dlq.subjects,
            "messages": dlq.messages,
            "exists": dlq.exists,
        },
        "strays": {
            "messages": strays.messages,
            "subjects": dict(strays.subjects),
            "purge": strays.purge_commands() if strays else [],
        },
        "problems": list(snap.problems) + ([strays.problem()] if strays else []),
        "global_order": _global_order(
            snap.global_position,
            reader_id,
            now,
            list((reader or {}).get("held_back_by") or []),
        ),
    }


def _global_order(
    gp: GlobalPosition | None, reader: str | None, now: float, held_back_by: list[str]
) -> Any:
    """A global-order reader's position (None for a group of per-key workers): the last
    global sequence handed over (in the time modes a time in ns since the epoch, also as
    RFC 3339 in ``position_time``), its token, who wrote it and when, late records (window
    modes), the running reader, if any, the producers holding its merge back (exact
    event-time mode) and why the last one stopped on its own (None: it runs, or was
    stopped by request)."""
    if gp is None:
        return None
    timed = gp.order != "sequence" and gp.g > 0
    return {
        "position": gp.g,
        "position_time": show_time(gp.g) if timed else None,
        "fencing_token": gp.token,
        "member": gp.member,
        "written_age": round(max(0.0, now - gp.ts), 3) if gp.ts else None,
        "late": gp.late,
        "reader": reader,
        "order": gp.order,
        "error": gp.error or None,
        "held_back_by": held_back_by,
    }


async def group_list(
    nc: NATS, stream: str | None = None, *, skip_vanished: bool = False
) -> dict[str, Any]:
    """Every group with state (of ``stream``, if given) summed up (``group list --json``).
    An unknown ``stream`` is an error (StreamNotFoundError), not "no groups".
    ``skip_vanished``: a group deleted between the listing and its summary is left out
    (a page refreshing while groups come and go) instead of failing the whole list."""
    if stream:
        await describe(nc, stream)
    summaries = []
    for ref in await find_groups(nc, stream):
        try:
            summaries.append(await summarize_group(nc, ref))
        except (NatsOrderedError, NotFoundError):
            if not skip_vanished:
                raise
    out: dict[str, Any] = {"groups": [s.to_dict() for s in summaries]}
    if stream:
        out["stream"] = stream
    return out


async def stream_list(nc: NATS) -> list[dict[str, Any]]:
    """The server's partitioned streams (those ``provision`` made), sorted by name: each one's
    partition count, current layout epoch and earlier layouts, subjects, replicas, message
    count, and ``error`` (instead of the rest) for one whose layout cannot be read."""
    found: list[dict[str, Any]] = []
    async for info in stream_infos(nc):
        name = info.config.name or ""
        if META_PARTITIONS not in (info.config.metadata or {}):
            continue
        try:
            s = await describe(nc, name)
        except StreamNotFoundError:
            continue  # deleted since the listing
        except NatsOrderedError as exc:
            found.append({"stream": name, "error": str(exc)})
            continue
        found.append(
            {
                "stream": s.name,
                "partitions": s.current_partitions,
                "epoch": s.current_epoch,
                "layouts": [lay.to_json() for lay in s.layouts],
                "subjects": s.subjects_text,
                "replicas": s.replicas,
                "messages": int(info.state.messages or 0),
                "created": s.created,
            }
        )
    return sorted(found, key=lambda d: d["stream"])


async def run_list(nc: NATS, stream: str, limit: int = 200) -> list[dict[str, Any]]:
    """The stream's run ledger (its named runs: complete, partial or running), newest start
    first, at most ``limit``; each the record's JSON (:meth:`RunRecord.to_dict`). An Airflow
    task's run is named ``<dag id>.<task id>[.<map index>].<logical date or run id>``
    (``operators.publish.default_producer_id``), so its ``producer_id`` names the DAG run
    that published it. Empty when nothing was published as a named run."""
    bucket = ledger_bucket(stream)
    try:
        keys = await bucket_keys(nc, bucket, "run.")
    except NotFoundError:
        return []
    runs: list[dict[str, Any]] = []
    for key in keys:
        entry = await latest_entry(nc, bucket, key)
        if entry is None or entry[0] is None:
            continue
        try:
            runs.append(RunRecord.from_dict(json.loads(entry[0])).to_dict())
        except (ValueError, TypeError):
            continue  # not a run record: nothing a reader can show
    runs.sort(key=lambda r: -float(r.get("started") or 0))
    return runs[:limit]


async def producer_list(nc: NATS, stream: str) -> list[dict[str, Any]]:
    """The stream's registered global producers (``global-producers --json``'s rows)."""
    now = time.time()
    return [
        {
            "producer": p,
            "state": m.state,
            "epoch": m.epoch,
            "watermark": None if m.e is None else show_time(m.e),
            "watermark_ns": m.e,
            "seq": f"{m.epoch}.{m.n}",
            "age": round(max(0.0, now - m.ts), 3) if m.ts else None,
            "closed_by": m.closed_by or None,
        }
        for p, m in sorted((await list_producers(nc, stream)).items())
    ]


async def drain_wait_status(
    nc: NATS, stream_name: str, group: str, marks: Mapping[str, int] | Mapping[int, int]
) -> dict[str, Any]:
    """Where a drain wait on ``marks`` (partition -> stream sequence, as the drain sensor
    keeps them) stands now, by the rule every drain wait applies
    (:func:`~.marks.marks_to_wait`): per mark the group's committed position, whether the
    partition is still behind it and the exact number of its records between the two
    (counted by the server, as the group's lag is); ``waiting_for`` says why the group
    cannot be drained whatever the marks say (a group still on an earlier layout, an
    unfinished repartition, stray messages), ``drained`` whether the wait would end now.
    A group without state yet (no worker has joined it) has committed nothing."""
    described = await describe(nc, stream_name)
    given = {int(p): int(m) for p, m in marks.items()}
    waiting: list[str] = []
    committed: dict[int, int] = {}
    blocked: dict[int, str | None] = {}
    exists = await group_exists(nc, stream_name, group)
    all_behind = False  # the group is on an earlier layout: every mark of it still waits
    if exists:
        store = await GroupStore.attach(nc, stream_name, group)
        lag = await read_group_lag(nc, described, store, await store.snapshot())
        committed = {p.partition: p.committed for p in lag.partitions}
        blocked = {p.partition: p.blocked for p in lag.partitions}
        if lag.strays:
            waiting.append(lag.strays.problem())
        if lag.switch_unfinished:
            waiting.append(
                pending_switch_problem(
                    stream_name,
                    described.current_partitions,
                    described.current_epoch,
                    lag.pending_switch if lag.pending_switch is not None else lag.epoch,
                )
            )
            all_behind = True
        elif lag.epoch != lag.stream_epoch:
            waiting.append(
                f"group {group} is still on layout epoch {lag.epoch} (the stream is at epoch "
                f"{lag.stream_epoch}): it moves once every earlier partition is applied"
            )
            all_behind = True
        switch_seq, partitions = lag.switch_seq, len(lag.partitions)
    else:
        switch_seq, partitions = recorded_switch(described), described.current_partitions
    pending = (
        {p: m for p, m in given.items() if m > 0}
        if all_behind
        else marks_to_wait(given, partitions=partitions, switch_seq=switch_seq, stream=stream_name)
    )
    rows: list[dict[str, Any]] = []
    behind_at: dict[int, tuple[int, int]] = {}
    for p, m in sorted(given.items()):
        c = committed.get(p, 0)
        is_behind = p in pending and (all_behind or c < pending[p])
        rows.append(
            {
                "partition": p,
                "mark": m,
                "committed": c if p in committed or not exists else None,
                "behind": is_behind,
                "lag_to_mark": 0 if not is_behind else None,
                "earlier_layout": p not in pending,
                "blocked": blocked.get(p),
            }
        )
        if is_behind and not all_behind:
            behind_at[p] = (c, m)
    if behind_at:  # exact: the partition's records after the committed position up to the mark
        after_c = await count_after(nc, described, {p: c for p, (c, _) in behind_at.items()})
        after_m = await count_after(nc, described, {p: m for p, (_, m) in behind_at.items()})
        for row in rows:
            p = row["partition"]
            if p in behind_at:
                row["lag_to_mark"] = max(0, after_c[p] - after_m[p])
    behind = [r["partition"] for r in rows if r["behind"]]
    return {
        "stream": described.name,
        "group": group,
        "group_exists": exists,
        "marks": rows,
        "behind": behind,
        "waiting_for": waiting,
        "drained": not behind and not waiting,
    }
