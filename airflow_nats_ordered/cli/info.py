"""``nats-ordered info``: a partitioned stream's per-partition message counts and last
sequences, and every stray message (stored on a subject that is not a partition subject).

Like ``status``, it is a report: it exits 0 whatever it finds, and lists what an operator
must act on under ``problems`` (``--json``: a list of strings, empty when there is none):
stray messages, and a repartition that has not recorded its switch point."""

from __future__ import annotations

import argparse

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    Command,
    connected,
    format_duration,
    format_table,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.stream.layout import pending_switch_problem
from airflow_nats_ordered.core.stream.partitioned import (
    describe,
    partition_stats,
    stream_contents,
    subjects_text,
)

#: stray subjects listed one per row in the table (all of them in --json)
STRAY_ROWS = 20


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument("--json", action="store_true", help="print a JSON object")


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        stream = await describe(nc, args.stream)
        contents = await stream_contents(nc, stream)
        # a repartitioned stream still holds its earlier layouts' messages (read by each
        # group before the current layout): counted, so the total is what the stream holds
        earlier = [
            (lay, await partition_stats(nc, stream.at_epoch(lay.epoch))) for lay in stream.layouts
        ]
    stats, strays = contents.partitions, contents.strays
    total = contents.messages + sum(s.messages for _, ss in earlier for s in ss)
    last = max((s.last_seq for _, ss in earlier for s in ss), default=0)
    last = max([last, *(s.last_seq for s in stats)])
    problems = []
    pending = stream.pending_switch
    if pending is not None:
        problems.append(
            pending_switch_problem(stream.name, stream.partitions, stream.epoch, pending.epoch)
        )
    if strays:
        problems.append(strays.problem())
    if args.json:
        print_json(
            {
                "stream": stream.name,
                "partitions": stream.partitions,
                "prefix": stream.prefix,
                "subjects": stream.subjects_text,
                "explicit_subjects": stream.explicit_subjects,
                "epoch": stream.epoch,
                "layouts": [lay.to_json() for lay in stream.layouts],
                "hash": stream.hash_name,
                "seed": stream.seed,
                "duplicate_window": stream.duplicate_window,
                "storage": stream.storage,
                "replicas": stream.replicas,
                # everything the stream holds: every layout's partitions and the strays
                "messages": total,
                "partition_stats": [
                    {
                        "partition": s.partition,
                        "subject": s.subject,
                        "messages": s.messages,
                        "last_seq": s.last_seq,
                    }
                    for s in stats
                ],
                "earlier_layouts": [
                    {
                        "epoch": lay.epoch,
                        "partitions": lay.partitions,
                        "switch_seq": lay.switch_seq,
                        "messages": sum(s.messages for s in ss),
                        "partition_stats": [
                            {
                                "partition": s.partition,
                                "subject": s.subject,
                                "messages": s.messages,
                                "last_seq": s.last_seq,
                            }
                            for s in ss
                        ],
                    }
                    for lay, ss in earlier
                ],
                "strays": {
                    "messages": strays.messages,
                    "subjects": dict(strays.subjects),
                    "problem": strays.problem() or None,
                    "purge": strays.purge_commands() if strays else [],
                },
                "problems": problems,
            }
        )
        return EXIT_OK
    stray_rows = [("stray", s, n, None) for s, n in list(strays.subjects.items())[:STRAY_ROWS]]
    if len(strays.subjects) > STRAY_ROWS:
        rest = list(strays.subjects.values())[STRAY_ROWS:]
        stray_rows.append(("stray", f"... {len(rest)} more subjects", sum(rest), None))
    print(
        format_table(
            ("partition", "subject", "messages", "last_seq"),
            [(s.partition, s.subject, s.messages, s.last_seq) for s in stats],
            footer=[
                *(
                    (
                        f"epoch {lay.epoch}",
                        f"{lay.partitions} partitions (earlier layout)",
                        sum(s.messages for s in ss),
                        max((s.last_seq for s in ss), default=0),
                    )
                    for lay, ss in earlier
                ),
                *stray_rows,
                ("total", "", total, last),
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
    if stream.layouts:
        listed = ", ".join(
            f"epoch {lay.epoch}: {lay.partitions} partitions "
            + ("(switch point pending)" if lay.pending else f"up to seq {lay.switch_seq}")
            for lay in stream.layouts
        )
        print(
            f"layout epoch {stream.epoch} ({stream.subjects_text}), repartitioned; earlier "
            f"layouts ({listed}) are read by each group before this one"
        )
    if not stream.explicit_subjects:
        print(
            f"subjects {stream.subjects_text}: the stream also stores publishes to subjects "
            "that are not partitions (as strays); `nats-ordered provision --stream "
            f"{stream.name} --partitions {stream.partitions}` narrows it to "
            f"{subjects_text(stream.prefix, stream.partitions)}"
        )
    for problem in problems:
        print(f"problem: {problem}")
    return EXIT_OK


COMMAND = Command(
    "info",
    "show a partitioned stream: per-partition message counts and last sequences",
    configure,
    run,
    "Messages stored on subjects that are not partition subjects (strays: no worker reads "
    "them) are listed after the partitions and counted in the total.",
)
