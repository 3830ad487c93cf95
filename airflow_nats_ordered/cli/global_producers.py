"""``nats-ordered global-producers``: list the producers registered in a stream's exact
event-time order (:class:`~airflow_nats_ordered.core.order.producer.GlobalProducer`), or close one
that died
so that readers stop waiting for it
(:func:`~airflow_nats_ordered.core.order.producers.close_producer`).

Exit codes: 0 listed, or closed (also when it was closed already); 2 for a stream without
global producers or an unknown producer id (the message lists the registered ones).
"""

from __future__ import annotations

import argparse

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    Command,
    connected,
    format_table,
    print_err,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.overview import producer_list
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.order.producers import (
    check_producer,
    close_producer,
)


def producer_id(text: str) -> str:
    try:
        return check_producer(text, "--close")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument(
        "--close",
        type=producer_id,
        metavar="ID",
        default=None,
        help="mark producer ID closed (it died and will not come back): readers stop waiting "
        "for it; a record of it stored later stops them (a violation), and a live instance "
        "of it is fenced (it publishes nothing more)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object")


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        closed = None
        if args.close is not None:
            closed = await close_producer(nc, args.stream, args.close)
        rows = await producer_list(nc, args.stream)
    if args.close is not None:
        print_err(
            f"producer {args.close} of stream {args.stream}: "
            + ("closed" if closed else "was closed already")
        )
    if args.json:
        print_json({"stream": args.stream, "producers": rows})
        return EXIT_OK
    if not rows:
        print(f"stream {args.stream} has no global producers")
        return EXIT_OK
    header = ["producer", "state", "watermark (event time)", "seq", "written"]
    table = [
        [
            r["producer"],
            r["state"] + (f" by {r['closed_by']}" if r["closed_by"] else ""),
            r["watermark"] or "-",
            r["seq"],
            "-" if r["age"] is None else f"{r['age']:.1f}s ago",
        ]
        for r in rows
    ]
    print(format_table(header, table))
    return EXIT_OK


COMMAND = Command(
    "global-producers",
    "list a stream's global producers, or close one that died",
    configure,
    run,
    "Lists the producers registered in the stream's exact event-time order (GlobalProducer: "
    "each stamps its records and writes watermarks into the bucket nor_<stream>_global) "
    "with their state and last watermark. A `global-read --order-by event-time --watermarks` "
    "reader waits for every registered producer that is not closed; `status` names the "
    "one holding it back. --close ID marks a producer that died closed so the readers go "
    "on (restarting it with the same producer id does that too, keeping its order).",
)
