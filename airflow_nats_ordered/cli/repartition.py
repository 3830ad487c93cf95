"""``nats-ordered repartition``: change a stream's partition count, keeping every key's order."""

from __future__ import annotations

import argparse
import sys

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    Command,
    connected,
    positive_int,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.stream.partitioned import MAX_PARTITIONS, STREAM_NAME_RULE
from airflow_nats_ordered.core.stream.repartition import repartition


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream",
        required=True,
        type=stream_name,
        metavar="S",
        help=f"stream name: {STREAM_NAME_RULE}",
    )
    p.add_argument(
        "--partitions",
        required=True,
        type=positive_int,
        metavar="N",
        help=f"the new partition count (1 to {MAX_PARTITIONS}, not the current one)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result as a JSON object (progress lines go to stderr)",
    )


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    out = sys.stderr if args.json else sys.stdout

    def progress(line: str) -> None:
        print(line, file=out, flush=True)

    async with connected(options) as nc:
        result = await repartition(nc, args.stream, args.partitions, progress=progress)
    if args.json:
        print_json(result.to_json())
        return EXIT_OK
    if result.action == "unchanged":
        print(
            f"stream {result.stream} already has {result.partitions} partitions: its "
            f"repartition from {result.previous_partitions} (epoch {result.previous_epoch} -> "
            f"{result.epoch}, switch point seq {result.switch_seq}) is complete; nothing to do"
        )
        return EXIT_OK
    done = (
        "completed the interrupted repartition of"
        if result.action == "completed"
        else ("repartitioned")
    )
    print(
        f"{done} stream {result.stream}: {result.previous_partitions} -> "
        f"{result.partitions} partitions (epoch {result.epoch}, subjects {result.subjects}); "
        f"switch point seq {result.switch_seq}. Publishers started before now are refused "
        "by the server (restart them: a new publisher reads the new layout); each group "
        "finishes the old partitions before it hands out any record of the new layout "
        f"(`nats-ordered status --stream {result.stream} --group G` shows where it is)"
    )
    return EXIT_OK


COMMAND = Command(
    "repartition",
    "change a stream's partition count without breaking any key's order",
    configure,
    run,
    "One stream update switches publishers to the new layout at a recorded point (the "
    "stream's layout epoch): the server refuses every publish still routed by the old "
    "layout, so a publisher that started before is refused, never routed wrong. Workers "
    "finish every old partition before any record of the new layout is handed out, so each "
    "key's order holds across the switch; commit records, leases, drain waits and fenced "
    "sinks keep working. A run that was interrupted (killed at any step) is completed by the "
    "next run, which says so; run again once complete, it changes nothing (exit 0). Refuses "
    "the count of a stream never repartitioned, an unknown stream and a repartition "
    "already running (exit 2).",
)
