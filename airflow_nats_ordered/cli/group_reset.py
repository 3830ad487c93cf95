"""``nats-ordered group reset``: move a group's committed positions (Kafka's
``kafka-consumer-groups.sh --reset-offsets``), a dry run unless ``--execute``."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    add_connection_flags,
    connected,
    format_table,
    group_name,
    partition_list,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.listing import require_group
from airflow_nats_ordered.core.admin.reset import (
    PartitionReset,
    ResetTarget,
    plan_reset,
    reset_group,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.config import GroupConfig

TO_HELP = (
    "earliest (re-process everything still in the stream), latest (skip everything stored "
    "so far), seq:N (each partition resumes with its first message after stream sequence N) "
    "or time:ISO8601 (each resumes with its first message stored at or after that time, "
    "e.g. time:2026-01-31T12:00:00Z; UTC unless it has an offset)"
)


def reset_target(text: str) -> ResetTarget:
    """``earliest``, ``latest``, ``seq:N`` (an int) or ``time:ISO8601`` (an aware datetime)."""
    t = text.strip()
    if t in ("earliest", "latest"):
        return t  # type: ignore[return-value]
    kind, sep, value = t.partition(":")
    if sep and kind == "seq":
        if value.strip().isdigit():
            return int(value)
    elif sep and kind == "time":
        try:
            when = dt.datetime.fromisoformat(value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid time {value!r}: use ISO 8601, e.g. time:2026-01-31T12:00:00Z"
            ) from None
        return when if when.tzinfo else when.replace(tzinfo=dt.UTC)
    raise argparse.ArgumentTypeError(f"invalid --to {text!r}: use {TO_HELP}")


def configure(actions: Any, parent: argparse.ArgumentParser) -> None:
    r = actions.add_parser(
        "reset",
        help="move a group's committed positions (Kafka's --reset-offsets); a dry run "
        "unless --execute",
        description="Show (the default, --dry-run) or apply (--execute) new committed "
        "positions for a group: per partition the position now, the new one and the lag "
        "before and after. The reset is fenced: each partition's position is written under "
        "a new fencing token and its lease is taken from its holder, so a running worker is "
        "not stopped but loses the partition: its next commit of it is refused (nothing it "
        "wrote under the old token counts), and the partition is claimed again (by it or "
        "another member) from the new position. Every target is checked before the first "
        "write. The sink is not reset: a fenced sink ignores sequences it already applied, "
        "so rewind it too when re-processing must re-apply.",
        epilog=parent.epilog,
        formatter_class=parent.formatter_class,
    )
    r.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    r.add_argument("--group", required=True, type=group_name, metavar="G", help="consumer group")
    r.add_argument("--to", required=True, type=reset_target, metavar="TARGET", help=TO_HELP)
    r.add_argument(
        "--partitions",
        type=partition_list,
        metavar="LIST",
        help="only these partitions, e.g. 0,3-5 (default: all)",
    )
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="only show the plan (the default)")
    mode.add_argument("--execute", action="store_true", help="apply the plan")
    r.add_argument("--json", action="store_true", help="print the plan (or result) as JSON")
    add_connection_flags(r)


def _row(p: PartitionReset) -> dict[str, Any]:
    return {
        "partition": p.partition,
        "owner": p.owner,
        "committed": p.committed,
        "new": p.target,
        "first": p.first,
        "last": p.last,
        "lag_before": p.lag_before,
        "lag_after": p.lag_after,
    }


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    GroupConfig(args.stream, args.group)  # a malformed name is a usage error before connecting
    async with connected(options) as nc:
        await require_group(nc, args.stream, args.group)
        try:
            if args.execute:
                done = await reset_group(
                    nc,
                    args.stream,
                    args.group,
                    to=args.to,
                    partitions=args.partitions,
                    confirm=True,
                )
                assert done.plan is not None
                plan = done.plan
            else:
                plan = await plan_reset(
                    nc, args.stream, args.group, to=args.to, partitions=args.partitions
                )
        except ConfigError as exc:
            raise ConfigError(f"--to/--partitions: {exc}") from None
    rows = [_row(p) for p in plan.partitions]
    if args.json:
        print_json(
            {
                "stream": plan.stream,
                "group": plan.group,
                "executed": bool(args.execute),
                "partitions": rows,
                "live_members": plan.live_members,
            }
        )
        return EXIT_OK
    print(
        format_table(
            ("partition", "owner", "committed", "new", "lag before", "lag after"),
            [
                (
                    r["partition"],
                    r["owner"],
                    r["committed"],
                    r["new"],
                    r["lag_before"],
                    r["lag_after"],
                )
                for r in rows
            ],
            footer=[
                (
                    "total",
                    "",
                    "",
                    "",
                    sum(r["lag_before"] for r in rows),
                    sum(r["lag_after"] for r in rows),
                )
            ],
        )
    )
    if plan.live_members:
        print(
            f"{len(plan.live_members)} live member(s) ({', '.join(plan.live_members)}): "
            + (
                "each owner lost its partition's lease and token; the partitions are claimed "
                "again from the new positions"
                if args.execute
                else "--execute fences them: each owner loses the partition's lease and "
                "token, and it is claimed again from the new position"
            )
        )
    if args.execute:
        print(f"reset group {plan.group} of {plan.stream}: {len(rows)} partition(s)")
    else:
        print("dry run: nothing changed; pass --execute to apply")
    return EXIT_OK
