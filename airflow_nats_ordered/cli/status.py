"""``nats-ordered status``: a group's owners, fencing tokens, committed positions and lag."""

from __future__ import annotations

import argparse
import time

from ..core.assignor import Assignment
from ..core.connection import ConnectionOptions
from ..core.group import GroupStore
from ..core.streams import describe, partition_stats
from .common import EXIT_OK, Command, connected, format_table, print_json


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="partitioned stream")
    p.add_argument("--group", required=True, metavar="G", help="consumer group")
    p.add_argument("--json", action="store_true", help="print a JSON object")


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        stream = await describe(nc, args.stream)
        stats = await partition_stats(nc, stream)
        store = await GroupStore.attach(nc, args.stream, args.group)
        snap = await store.snapshot()
    generation = None
    if snap.assignment:
        generation = Assignment.from_json(snap.assignment).generation
    now = time.time()
    parts = []
    for s in stats:
        c = snap.commits.get(s.partition)
        committed = c.seq if c else 0
        owner = snap.leases.get(s.partition, (None, 0))[0]
        parts.append(
            {
                "partition": s.partition,
                "owner": owner,
                "fencing_token": c.token if c else 0,
                "committed": committed,
                "last": s.last_seq,
                "lag": _lag(s.last_seq, committed, s.messages),
                "blocked": snap.blocked.get(s.partition),
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
    out = {
        "stream": stream.name,
        "group": args.group,
        "generation": generation,
        "leader": snap.leader,
        "partitions": parts,
        "members": members,
    }
    if args.json:
        print_json(out)
        return EXIT_OK
    print(
        format_table(
            ("partition", "owner", "token", "committed", "last", "lag", "blocked"),
            [
                (
                    p["partition"],
                    p["owner"],
                    p["fencing_token"],
                    p["committed"],
                    p["last"],
                    p["lag"],
                    p["blocked"],
                )
                for p in parts
            ],
            footer=[("total", "", "", "", "", sum(p["lag"] for p in parts), "")],
        )
    )
    print()
    print(
        format_table(
            ("member", "host", "pid", "partitions", "heartbeat age"),
            [
                (
                    m["member"],
                    m["host"],
                    m["pid"],
                    len(m["partitions"]),
                    f"{m['heartbeat_age']:.1f}s",
                )
                for m in members
            ],
        )
        if members
        else "no live members"
    )
    print(
        f"group {args.group} of {stream.name}: generation {generation or '-'}, "
        f"leader {snap.leader or '-'}, {len(members)} member(s), "
        f"lag {sum(p['lag'] for p in parts):,}"
    )
    return EXIT_OK


def _lag(last: int, committed: int, messages: int) -> int:
    """Messages after the committed position (an upper bound: sequences are shared by all
    partitions, so the count comes from the partition's own messages)."""
    if committed >= last:
        return 0
    return messages if committed == 0 else min(messages, last - committed)


COMMAND = Command(
    "status",
    "show a group: owner, fencing token, committed position and lag per partition",
    configure,
    run,
)
