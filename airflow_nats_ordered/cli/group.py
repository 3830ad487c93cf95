"""``nats-ordered group``: administer consumer groups as ``kafka-consumer-groups.sh`` does:
``group list``, ``group describe`` (``status``), ``group reset``, ``group rebalance``,
``group delete``."""

from __future__ import annotations

import argparse

from airflow_nats_ordered.cli import group_list, group_rebalance, group_reset, status
from airflow_nats_ordered.cli.common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    add_connection_flags,
    connected,
    group_name,
    print_err,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.delete import GroupInUseError, delete_group
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.group.config import GroupConfig


def configure(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    d = actions.add_parser(
        "delete",
        help="delete a group's state (leases, commits, fencing tokens, assignment)",
        description="Delete a consumer group's two KV buckets (nor_<stream>_<group>_leases "
        "and nor_<stream>_<group>_state). Refused while members are alive unless --force. "
        "The group's dead letters (stream <STREAM>_DLQ, subjects <prefix>.dlq.<group>.*, "
        "shared with the stream's other groups) are kept unless --dead-letters. A group "
        "started again under the same name reads the stream from its first message.",
        epilog=p.epilog,
        formatter_class=p.formatter_class,
    )
    d.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    d.add_argument(
        "--group", required=True, type=group_name, metavar="G", help="consumer group to delete"
    )
    d.add_argument(
        "--force",
        action="store_true",
        help="delete even while members are alive (they fail on their next commit or renewal)",
    )
    d.add_argument(
        "--dead-letters",
        action="store_true",
        help="also purge the group's dead letters; the dead-letter stream itself is deleted "
        "when it is then empty and no other group of the stream has state",
    )
    d.add_argument("--json", action="store_true", help="print the result as a JSON object")
    add_connection_flags(d)
    group_list.configure(actions, p)
    group_reset.configure(actions, p)
    group_rebalance.configure(actions, p)
    s = actions.add_parser(
        "describe",
        help="show one group per partition: the same as `nats-ordered status`",
        description="An alias of `nats-ordered status` (Kafka's `kafka-consumer-groups.sh "
        "--describe`): owner, fencing token, committed position and lag per partition, live "
        "members, dead letters and problems; every flag of status works here.",
        epilog=p.epilog,
        formatter_class=p.formatter_class,
    )
    status.configure(s)
    add_connection_flags(s)


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    if args.action == "list":
        return await group_list.run(args, options)
    if args.action == "reset":
        return await group_reset.run(args, options)
    if args.action == "rebalance":
        return await group_rebalance.run(args, options)
    if args.action == "describe":
        return await status.run(args, options)
    return await _delete(args, options)


async def _delete(args: argparse.Namespace, options: ConnectionOptions) -> int:
    GroupConfig(args.stream, args.group)  # a malformed name is a usage error before connecting
    async with connected(options) as nc:
        try:
            done = await delete_group(
                nc, args.stream, args.group, force=args.force, dead_letters=args.dead_letters
            )
        except GroupNotFoundError as exc:
            kept = (
                f"; its {exc.dead_letters_kept:,} dead letter(s) are kept: pass --dead-letters "
                "to purge them (see them with `nats-ordered dead-letters list`)"
                if exc.dead_letters_kept
                else ""
            )
            print_err(
                f"error: group {args.group} of stream {args.stream} does not exist: it has no "
                f"state (no KV buckets){kept}"
            )
            return EXIT_USAGE
        except GroupInUseError as exc:
            print_err(
                f"error: group {args.group} of stream {args.stream} has {len(exc.members)} live "
                f"member(s): {', '.join(exc.members)}. Stop its workers first (they leave the "
                "group on SIGTERM), or pass --force to delete it under them"
            )
            return EXIT_INCOMPLETE
    if args.json:
        print_json(
            {
                "stream": done.stream,
                "group": done.group,
                "buckets_deleted": done.buckets,
                "live_members": done.live_members,
                "dead_letters_purged": done.dead_letters_purged,
                "dead_letter_stream_deleted": done.dead_letter_stream_deleted,
                "dead_letter_stream_kept": done.dead_letter_stream_kept,
            }
        )
        return EXIT_OK
    what = ", ".join(done.buckets) or "no buckets (already gone)"
    print(f"deleted group {done.group} of {done.stream}: {what}")
    if done.live_members:
        print_err(
            f"warning: deleted under {len(done.live_members)} live member(s) "
            f"({', '.join(done.live_members)}); stop them"
        )
    if args.dead_letters:
        line = f"dead letters: {done.dead_letters_purged:,} purged"
        if done.dead_letter_stream_deleted:
            line += ", dead-letter stream deleted (it was empty)"
        elif done.dead_letter_stream_kept:
            line += f", dead-letter stream kept: {done.dead_letter_stream_kept}"
        print(line)
    else:
        print("dead letters kept (pass --dead-letters to purge them)")
    return EXIT_OK


COMMAND = Command(
    "group",
    "administer consumer groups: list, describe, reset (positions), rebalance, delete",
    configure,
    run,
    connection_flags=False,
)
