"""``nats-ordered global-read``: hand every partition's records to one handler in one exact
global order (:class:`~airflow_nats_ordered.core.order.reader.GlobalOrderReader`), until told to
stop.

Exit codes: 2 for what stops the reader before it took its position (flags, handler,
connection, stream); 3 when it stops on an error after that (a record outside the global
order, a handler that raised, a newer reader of the group); 0 after SIGTERM/SIGINT, once
the record in hand is finished and the position written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import signal

from nats.errors import Error as NatsError

from airflow_nats_ordered.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Command,
    connected,
    denial_in_cli_terms,
    group_name,
    positive_float,
    positive_int,
    positive_size,
    print_err,
    stream_name,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.order.event_time import DEFAULT_TIME_HEADER, FORMS, EventTimeError
from airflow_nats_ordered.core.order.reader import GlobalOrderReader
from airflow_nats_ordered.core.order.window import LateRecordError
from airflow_nats_ordered.members.handlers import current_directory_first, load_handler


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument(
        "--group",
        required=True,
        type=group_name,
        metavar="G",
        help="the reader's group: it keeps the position (one reader per group at a time)",
    )
    p.add_argument(
        "--handler",
        required=True,
        metavar="MODULE:FUNC",
        help="the handler, e.g. mypkg.ledger:apply: called with one GlobalMessage at a time, "
        "in global order (a function, coroutine or class, as for `worker`); its module is "
        "looked up in the current directory first",
    )
    p.add_argument(
        "--commit-every",
        type=positive_int,
        default=500,
        metavar="N",
        help="write the position every N records (default 500)",
    )
    p.add_argument(
        "--commit-interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="... or every this many seconds (default 1)",
    )
    p.add_argument(
        "--fetch-batch",
        type=positive_int,
        default=500,
        metavar="N",
        help="records read per request and partition (default 500)",
    )
    p.add_argument(
        "--max-buffer-bytes",
        type=positive_size,
        default=64 * 1024 * 1024,
        metavar="SIZE",
        help="bytes of read, not yet handled records the reader may hold, shared by the "
        "partitions, e.g. 64MiB (default 64MiB)",
    )
    p.add_argument(
        "--member-id", metavar="ID", default=None, help="who writes the position (default HOST-PID)"
    )
    p.add_argument(
        "--order-by",
        choices=("sequence", "time", "event-time"),
        default="sequence",
        help="sequence (default): the exact merge by Nats-Global-Seq (publish --global-order); "
        "time: the time-window mode for records of any producer, ordered by the time the "
        "server stored them and released --lateness after it; event-time: the same window, "
        "ordered by the producers' event time in --time-header (ties: stream sequence), so "
        "several producers, foreign clients too, share one order (see docs/architecture/order.md, "
        "Time-window mode)",
    )
    p.add_argument(
        "--watermarks",
        action="store_true",
        help="with --order-by event-time: the exact mode for several producers publishing at "
        "once through GlobalProducer (each stamps its event time and writes watermarks): "
        "ordered by (event time, producer, producer seq) with no window, a record handed over "
        "once every registered producer that is not closed is past it; a silent producer "
        "holds the reader back (`status` names it, `global-producers --close ID` closes one "
        "that died). --lateness, --late and --time-header do not apply",
    )
    p.add_argument(
        "--time-header",
        default=None,
        metavar="NAME",
        help=f"with --order-by event-time: the header holding a record's event time (default "
        f"{DEFAULT_TIME_HEADER}): integer Unix epoch milliseconds or RFC 3339 with a time "
        "zone; a record without it, or with another value, stops the reader (exit 3) unless "
        "--late dead-letter sets it aside",
    )
    p.add_argument(
        "--lateness",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="with --order-by time or event-time: the window (default 2); a record that "
        "reaches the reader later than this after it was stored (event-time: after its "
        "event time) may be late",
    )
    p.add_argument(
        "--late",
        choices=("block", "dead-letter", "flag"),
        default=None,
        help="with --order-by time or event-time: what to do with a late record: block "
        "(default: stop, exit 3), dead-letter (to <prefix>.dlq.<group>.<partition>), flag "
        "(hand it over with msg.late set)",
    )


def in_cli_terms(exc: BaseException, order_by: str) -> str:
    """The reader's error in this command's terms (its flags, not the Python parameters)."""
    if isinstance(exc, LateRecordError):
        what = "has an event time" if order_by == "event-time" else "was stored"
        return (
            f"late record: partition {exc.partition}, stream sequence {exc.seq} {what} before "
            "records already handed over; the reader stopped before it (--late block). Pass "
            "a larger --lateness, or --late dead-letter to set late records aside, or --late "
            "flag"
        )
    if isinstance(exc, EventTimeError):
        return (
            f"no event time: header {exc.header} of partition {exc.partition}, stream "
            f"sequence {exc.seq}: {exc.why}. The record has no place in the event-time order, "
            f"so the reader stopped before it. Have its producer set {exc.header} ({FORMS}), "
            "pass the header it does set as --time-header, or pass --late dead-letter to set "
            "such records aside"
        )
    return str(exc).replace("without watermarks=True", "without --watermarks")


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    if args.watermarks and args.order_by != "event-time":
        raise ConfigError(
            "--watermarks is the exact event-time mode: pass --order-by event-time with it"
        )
    for flag, value in (
        ("--lateness", args.lateness),
        ("--late", args.late),
        ("--time-header", args.time_header),
    ):
        if args.watermarks and value is not None:
            raise ConfigError(
                f"{flag} applies to the window modes; --watermarks (the exact event-time "
                f"mode) has no window and reads {DEFAULT_TIME_HEADER}: leave {flag} out, or "
                "leave --watermarks out"
            )
    if args.order_by == "sequence":
        for flag, value in (("--lateness", args.lateness), ("--late", args.late)):
            if value is not None:
                raise ConfigError(
                    f"{flag} applies to --order-by time or event-time; pass one of them with "
                    f"{flag}, or leave {flag} out"
                )
    if args.time_header is not None and args.order_by != "event-time":
        raise ConfigError(
            "--time-header applies to --order-by event-time; pass both, or leave --time-header out"
        )
    current_directory_first()
    loaded = load_handler(args.handler, stream=args.stream, group=args.group)
    options = dataclasses.replace(options, max_reconnect_attempts=-1)
    async with connected(options) as nc:
        reader = GlobalOrderReader(
            nc,
            args.stream,
            args.group,
            loaded.handler,
            commit_every=args.commit_every,
            commit_interval=args.commit_interval,
            fetch_batch=args.fetch_batch,
            max_buffer_bytes=args.max_buffer_bytes,
            member_id=args.member_id,
            order_by=args.order_by,
            lateness=args.lateness,
            late=args.late,
            time_header=args.time_header,
            watermarks=args.watermarks,
        )
        # what `status` shows of an error that stops it: in this command's terms too
        reader.error_text = lambda exc: in_cli_terms(exc, args.order_by)
        await reader.start()  # before this, errors are usage errors (exit 2)
        print_err(
            f"global-order reader {reader.member_id} of {args.stream}/{args.group}: "
            f"resuming after global sequence {reader.position}"
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.ensure_future(stop.wait())
        done = asyncio.ensure_future(reader.wait())
        await asyncio.wait({waiter, done}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        try:
            await reader.stop()
        except (NatsOrderedError, NatsError, TimeoutError) as exc:
            reader.error = reader.error or exc
        if loaded.close is not None:
            r = loaded.close()
            if inspect.isawaitable(r):
                await r
        with contextlib.suppress(BaseException):
            await done
    st = reader.stats
    if reader.error is not None:
        error = denial_in_cli_terms(reader.error, args, options) or in_cli_terms(
            reader.error, args.order_by
        )
        print_err(
            f"error: global-order reader {reader.member_id} stopped after global sequence "
            f"{reader.position}: {error}"
        )
        return EXIT_FAILED
    late = f", {st.late:,} late" if args.order_by != "sequence" and not args.watermarks else ""
    print_err(
        f"global-order reader {reader.member_id} stopped: {st.handled:,} records handled"
        f"{late}, position {reader.position}"
    )
    return EXIT_OK


COMMAND = Command(
    "global-read",
    "hand every partition's records to one handler in one exact global order",
    configure,
    run,
    "Reads a stream published with a global sequence (publish --global-order, or "
    "PublisherConfig(global_order=GlobalOrder())) and merges its partitions by it, exactly: a "
    "record is handed over only once no smaller one can still arrive (watermarks advance idle "
    "partitions). The position is kept in the group's state bucket; after a crash the records "
    "after the last written position are handed over again, in the same order. SIGTERM/SIGINT: "
    "finish the record in hand, write the position and exit 0. Exit 3 when it stops on an error: a "
    "record outside the global order, a handler that raised (it is handed over again on restart), "
    "or a newer reader of the same group, or (--order-by time or event-time, --late block) a late "
    "record, or (event-time, unless --late dead-letter) a record without a usable --time-header. "
    "--order-by event-time --watermarks merges several GlobalProducer producers exactly, with no "
    "window (see `global-producers`). `status` shows why a reader stopped. See "
    "docs/architecture/order.md.",
)
