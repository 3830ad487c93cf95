"""``nats-ordered info``: a partitioned stream's per-partition message counts and last sequences."""

from __future__ import annotations

import argparse

from ..core.connection import ConnectionOptions
from ..core.streams import describe, partition_stats
from .common import EXIT_OK, Command, connected, format_duration, format_table, print_json


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="partitioned stream")
    p.add_argument("--json", action="store_true", help="print a JSON object")


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        stream = await describe(nc, args.stream)
        stats = await partition_stats(nc, stream)
    if args.json:
        print_json(
            {
                "stream": stream.name,
                "partitions": stream.partitions,
                "prefix": stream.prefix,
                "hash": stream.hash_name,
                "seed": stream.seed,
                "duplicate_window": stream.duplicate_window,
                "storage": stream.storage,
                "replicas": stream.replicas,
                "messages": sum(s.messages for s in stats),
                "partition_stats": [
                    {
                        "partition": s.partition,
                        "subject": s.subject,
                        "messages": s.messages,
                        "last_seq": s.last_seq,
                    }
                    for s in stats
                ],
            }
        )
        return EXIT_OK
    print(
        format_table(
            ("partition", "subject", "messages", "last_seq"),
            [(s.partition, s.subject, s.messages, s.last_seq) for s in stats],
            footer=[
                (
                    "total",
                    "",
                    sum(s.messages for s in stats),
                    max((s.last_seq for s in stats), default=0),
                )
            ],
        )
    )
    print(
        f"stream {stream.name}: {stream.partitions} partitions, prefix {stream.prefix}, "
        f"hash {stream.hash_name} seed {stream.seed}, "
        f"duplicate window {format_duration(stream.duplicate_window)}, "
        f"{stream.storage} storage, {stream.replicas} "
        f"replica{'s' if stream.replicas != 1 else ''}"
    )
    return EXIT_OK


COMMAND = Command(
    "info",
    "show a partitioned stream: per-partition message counts and last sequences",
    configure,
    run,
)
