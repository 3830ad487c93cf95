"""``nats-ordered global-read``: hand every partition's records to one handler in one exact
global order (:class:`~..core.global_order.GlobalOrderReader`), until told to stop.

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

from ..core.connection import ConnectionOptions
from ..core.errors import NatsOrderedError
from ..core.global_order import GlobalOrderReader
from ..handlers import current_directory_first, load_handler
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Command,
    connected,
    group_name,
    positive_float,
    positive_int,
    positive_size,
    print_err,
    stream_name,
)


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


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
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
        )
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
        print_err(
            f"error: global-order reader {reader.member_id} stopped after global sequence "
            f"{reader.position}: {reader.error}"
        )
        return EXIT_FAILED
    print_err(
        f"global-order reader {reader.member_id} stopped: {st.handled:,} records handled, "
        f"position {reader.position}"
    )
    return EXIT_OK


COMMAND = Command(
    "global-read",
    "hand every partition's records to one handler in one exact global order",
    configure,
    run,
    "Reads a stream published with a global sequence (PublisherConfig(global_order=True)) "
    "and merges its partitions by it, exactly: a record is handed over only once no smaller "
    "one can still arrive (watermarks advance idle partitions). The position is kept in the "
    "group's state bucket; after a crash the records after the last written position are "
    "handed over again, in the same order. SIGTERM/SIGINT: finish the record in hand, "
    "write the position and exit 0. Exit 3 when it stops on an error: a record outside "
    "the global order, a handler that raised (it is handed over again on restart), or a "
    "newer reader of the same group. See docs/architecture.md, Global order.",
)
