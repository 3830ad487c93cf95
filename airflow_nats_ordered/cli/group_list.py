"""``nats-ordered group list``: every consumer group (of a stream), with its members, lag,
dead letters and problems (Kafka's ``kafka-consumer-groups.sh --list`` with
``--describe --all-groups``'s totals)."""

from __future__ import annotations

import argparse
from typing import Any

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    add_connection_flags,
    connected,
    format_table,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.listing import GroupSummary
from airflow_nats_ordered.core.admin.overview import group_list
from airflow_nats_ordered.core.connection.options import ConnectionOptions


def configure(actions: Any, parent: argparse.ArgumentParser) -> None:
    g = actions.add_parser(
        "list",
        help="list consumer groups with their members, lag, dead letters and problems",
        description="Every consumer group that has state (a worker joined it): its stream, "
        "live members, partitions held, total lag, drained or not, blocked partitions, dead "
        "letters and the problems `status` reports. Without --stream, the groups of every "
        "stream. `nats-ordered status --stream S --group G` (or `group describe`) shows one "
        "group per partition.",
        epilog=parent.epilog,
        formatter_class=parent.formatter_class,
    )
    g.add_argument(
        "--stream",
        type=stream_name,
        metavar="S",
        help="only the groups of this stream (default: every stream)",
    )
    g.add_argument("--json", action="store_true", help="print a JSON object")
    add_connection_flags(g)


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        # an unknown stream is an error, not "no groups"; the Airflow view shows the same
        out = await group_list(nc, args.stream)
    if args.json:
        print_json(out)
        return EXIT_OK
    summaries = [GroupSummary(**g) for g in out["groups"]]
    if not summaries:
        where = f"stream {args.stream}" if args.stream else "this server"
        print(f"no consumer groups on {where} (a group exists once a worker joins it)")
        return EXIT_OK
    print(
        format_table(
            (
                "stream",
                "group",
                "members",
                "partitions",
                "lag",
                "drained",
                "blocked",
                "dead letters",
                "problems",
            ),
            [
                (
                    s.stream,
                    s.group,
                    len(s.members),
                    f"{s.owned}/{s.partitions}",
                    s.total_lag,
                    "yes" if s.drained else "no",
                    ",".join(str(p) for p in s.blocked) or None,
                    s.dead_letters,
                    len(s.problems),
                )
                for s in summaries
            ],
        )
    )
    troubled = [s for s in summaries if s.problems]
    for s in troubled:
        print(f"\n{s.stream}/{s.group} problems:")
        for problem in s.problems:
            print(f"  - {problem}")
    return EXIT_OK
