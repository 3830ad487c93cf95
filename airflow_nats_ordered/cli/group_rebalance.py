"""``nats-ordered group rebalance``: ask a running group's leader for a new assignment now
(by partition count, or by measured load) or cordon members before maintenance, and wait
until every moved partition is held by its new owner (what ``NatsRebalanceOperator`` does)."""

from __future__ import annotations

import argparse
from typing import Any

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    add_connection_flags,
    connected,
    format_table,
    group_name,
    non_negative_float,
    parse_duration,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.listing import require_group
from airflow_nats_ordered.core.admin.rebalance import partition_rates, rebalance_group
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.config import GroupConfig


def _members(text: str) -> list[str]:
    found = [m.strip() for m in text.split(",") if m.strip()]
    if not found:
        raise argparse.ArgumentTypeError("give member ids, e.g. host-a-1,host-a-2")
    return found


def configure(actions: Any, parent: argparse.ArgumentParser) -> None:
    r = actions.add_parser(
        "rebalance",
        help="reassign a running group's partitions now (by load, or cordoning members)",
        description="Ask the group's leader for a new assignment now and wait until every "
        "partition is held by its assigned owner. Without flags, partitions are spread evenly "
        "by count, moving as few as possible. --by-load weighs each partition by its "
        "messages/s over --window (measured on the server). --cordon takes every partition "
        "away from the named members (before maintenance); it stays in force until the next "
        "rebalance without them, so name a member still down for its maintenance again when "
        "cordoning another. A member id the group does not know (not live, owning nothing, "
        "not cordoned) is refused, listing the live members. The group's workers must be "
        "running: the leader applies the request (the policy record in the group's state "
        "bucket).",
        epilog=parent.epilog,
        formatter_class=parent.formatter_class,
    )
    r.add_argument("--stream", required=True, type=stream_name, metavar="S", help="stream")
    r.add_argument("--group", required=True, type=group_name, metavar="G", help="consumer group")
    r.add_argument(
        "--cordon",
        type=_members,
        default=[],
        metavar="MEMBERS",
        help="comma list of member ids to take every partition away from (as `status` "
        "lists them; unknown ids are refused)",
    )
    r.add_argument(
        "--by-load",
        action="store_true",
        help="balance by each partition's messages/s over --window, not by count",
    )
    r.add_argument(
        "--window",
        type=parse_duration,
        default=3600.0,
        metavar="DURATION",
        help="with --by-load: the time the rates are measured over (default 1h)",
    )
    r.add_argument(
        "--slack",
        type=non_negative_float,
        default=0.0,
        metavar="F",
        help="with --by-load: how far above the average load a member may stay, as a "
        "fraction (default 0: as tight as the weights allow)",
    )
    r.add_argument(
        "--timeout",
        type=parse_duration,
        default=60.0,
        metavar="DURATION",
        help="give up when the group has not settled after this long (default 60s)",
    )
    r.add_argument("--json", action="store_true", help="print a JSON object")
    add_connection_flags(r)


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    GroupConfig(args.stream, args.group)
    if not args.by_load and (args.window != 3600.0 or args.slack):
        raise ConfigError("--window and --slack apply to --by-load; pass it, or drop them")
    async with connected(options) as nc:
        await require_group(nc, args.stream, args.group)
        weights = await partition_rates(nc, args.stream, args.window) if args.by_load else None
        done = await rebalance_group(
            nc,
            args.stream,
            args.group,
            cordon=args.cordon,
            weights=weights,
            slack=args.slack,
            timeout=args.timeout or 60.0,
        )
    if args.json:
        print_json(done.to_dict())
        return EXIT_OK
    if done.moves:
        print(
            format_table(
                ("partition", "from", "to"),
                [(p, a, b) for p, (a, b) in sorted(done.moves.items())],
            )
        )
    line = (
        f"group {done.group} of {done.stream}: generation {done.generation}, "
        f"{len(done.moves)} partition(s) moved, settled in {done.settled_in:.1f}s"
    )
    if done.imbalance_before is not None and done.imbalance_after is not None:
        line += f"; imbalance {done.imbalance_before:.2f} -> {done.imbalance_after:.2f}"
    print(line)
    return EXIT_OK
