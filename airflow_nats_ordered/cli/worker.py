"""``nats-ordered worker``: run one member of a consumer group until it is told to stop.

Exit codes, as a supervisor (``nats-ordered pool``, systemd) relies on them: 2 only for
what stops the member before it joined the group (flags, handler, connection, stream,
group settings); 3 for a member that stopped on an error after it joined, including its
group being deleted under it (``group delete --force``); 0 after a graceful leave.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import inspect
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from nats.errors import Error as NatsError

from airflow_nats_ordered.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Command,
    connected,
    error_in_cli_terms,
    format_size,
    group_name,
    positive_float,
    positive_int,
    positive_size,
    print_err,
    stream_name,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError, PermissionDenied
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.presence import GroupDeletedError
from airflow_nats_ordered.core.worker.worker import Worker
from airflow_nats_ordered.members.handlers import current_directory_first, load_handler
from airflow_nats_ordered.members.metrics import MemberMetrics, MetricsServer, serve_member

#: WorkerConfig's defaults, which the flags share (one place to change them)
_DEFAULTS = WorkerConfig("S", "g")


def configure(p: argparse.ArgumentParser) -> None:
    add_member_flags(p)
    p.add_argument(
        "--member-id", metavar="ID", default=None, help="stable member id (default: HOST-PID)"
    )
    add_metrics_flags(p, "this member's")


def add_metrics_flags(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help=f"serve {whose} Prometheus metrics on http://ADDR:PORT/metrics and its health "
        "on /healthz (503 when it cannot renew its leases) (default: not served)",
    )
    p.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default 127.0.0.1, this host only; "
        "0.0.0.0 for every interface, e.g. in a container that Prometheus scrapes)",
    )


def add_member_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a member's work, shared by ``worker`` and ``pool``."""
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument(
        "--group",
        required=True,
        type=group_name,
        metavar="G",
        help="consumer group: members share its partitions; each group sees all",
    )
    p.add_argument(
        "--handler",
        required=True,
        metavar="MODULE:FUNC",
        help="the handler, e.g. mypkg.handlers:apply (a function, coroutine or "
        "class; see airflow_nats_ordered.members.handlers); its module is looked up in the current "
        "directory first, then PYTHONPATH and installed packages (as with python -m)",
    )
    p.add_argument(
        "--lease-ttl",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="partition lease TTL; a dead member's partitions move after it "
        "(default 5; every member of a group must use the same)",
    )
    p.add_argument(
        "--fetch-batch",
        type=positive_int,
        default=100,
        metavar="N",
        help="messages read per request, two requests in flight per partition (default 100; "
        "raise it where the round trip to the server is long)",
    )
    p.add_argument(
        "--commit-every",
        type=positive_int,
        default=_DEFAULTS.commit_every,
        metavar="N",
        help="commit the position every N messages (default %(default)s; each write is sent "
        "at once and, with a synchronous handler, awaited before the next N, so a SIGKILL "
        "re-delivers at most one period of the partition in hand)",
    )
    p.add_argument(
        "--commit-interval",
        type=positive_float,
        default=_DEFAULTS.commit_interval,
        metavar="SECONDS",
        help="... or every this many seconds (default %(default)s)",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=3,
        metavar="N",
        help="handler retries before the poison policy applies (default 3)",
    )
    p.add_argument(
        "--retry-backoff",
        type=positive_float,
        default=0.2,
        metavar="SECONDS",
        help="first retry delay, doubled each retry (default 0.2)",
    )
    p.add_argument(
        "--poison",
        choices=("dead-letter", "block"),
        default="dead-letter",
        help="after the retries: publish to <prefix>.dlq.<group>.<partition> and "
        "move on (default), or block the partition and report it in status",
    )
    p.add_argument(
        "--batch-handler",
        action="store_true",
        help="call the handler with a list of messages per fetched batch",
    )
    p.add_argument(
        "--max-buffer-bytes",
        type=positive_size,
        metavar="SIZE",
        help="bytes of fetched, not yet handled messages this member may hold, shared by "
        "its partitions, e.g. 64MiB (default "
        f"{format_size(_default('max_buffer_bytes'))})",
    )
    p.add_argument(
        "--state-replicas",
        type=positive_int,
        metavar="R",
        help="replicas of the group's KV buckets when the first member creates them "
        "(default: the stream's replica count)",
    )
    p.add_argument(
        "--missing-commit",
        choices=("fail", "earliest", "latest"),
        help="where a partition resumes if its commit record disappeared although it had "
        "one: refuse it and report it in status (fail), from its first message (earliest) "
        f"or after its last one (latest) (default {_default('missing_commit')})",
    )
    p.add_argument(
        "--audit-log",
        metavar="FILE",
        default=None,
        help="append lease windows and assignments as JSON lines (for audits)",
    )


def _default(name: str) -> Any:
    """A WorkerConfig default, for help texts (the dataclass is the one home of defaults)."""
    return WorkerConfig.__dataclass_fields__[name].default


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    kw: dict[str, Any] = dict(
        lease_ttl=args.lease_ttl,
        fetch_batch=args.fetch_batch,
        commit_every=args.commit_every,
        commit_interval=args.commit_interval,
        max_retries=args.max_retries,
        retry_backoff=args.retry_backoff,
        poison=args.poison,
        batch_handler=args.batch_handler,
        audit_log=args.audit_log,
    )
    for name in ("max_buffer_bytes", "state_replicas", "missing_commit"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.member_id:
        kw["member_id"] = args.member_id
    return WorkerConfig(args.stream, args.group, **kw)


@contextlib.contextmanager
def _serving_metrics(worker: Worker, nc: Any, args: argparse.Namespace) -> Iterator[None]:
    """Metrics and health on ``--metrics-port`` (if given) while the block runs."""
    if args.metrics_port is None:
        yield
        return
    server, metrics = serve_metrics(worker, nc, args.metrics_port, args.metrics_addr)
    probe = asyncio.ensure_future(metrics.run())
    try:
        yield
    finally:
        probe.cancel()
        server.close()


def serve_metrics(
    worker: Worker, nc: Any, port: int, addr: str
) -> tuple[MetricsServer, MemberMetrics]:
    """Serve ``worker``'s metrics and health; a port in use is a usage error."""
    try:
        return serve_member(worker, nc, port, addr)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port {port}: cannot listen on {addr}:{port} ({exc.strerror}); "
            "pick a free port"
        ) from None


def _install_stack_dumps(loop: asyncio.AbstractEventLoop) -> None:
    """``kill -USR1 <pid>``: every thread's stack to stderr, even if the event loop is
    blocked (faulthandler, in C). ``kill -USR2 <pid>``: every asyncio task's stack (needs
    a running loop). For a member that does not stop or does not make progress."""
    with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def dump_tasks() -> None:
        tasks = asyncio.all_tasks(loop)
        lines = [f"--- {len(tasks)} asyncio tasks ---"]
        for t in tasks:
            lines.append(f"task {t.get_name()}:")
            # the whole await chain (Task.print_stack shows only the outermost coroutine)
            coro: Any = t.get_coro()
            while coro is not None:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    code = frame.f_code
                    lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        print("\n".join(lines), file=sys.stderr, flush=True)

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    cfg = _worker_config(args)
    current_directory_first()
    loaded = load_handler(args.handler, stream=args.stream, group=args.group)
    # a long-running member rides out server restarts: reconnect for as long as it takes
    options = dataclasses.replace(options, max_reconnect_attempts=-1)
    joined = False
    try:
        async with connected(options) as nc:
            worker = Worker(
                nc,
                cfg,
                loaded.handler,
                on_assign=loaded.on_assign,
                on_revoke=loaded.on_revoke,
                fencing_floor=loaded.fencing_floor,
            )
            with _serving_metrics(worker, nc, args):
                crashed = await _run_member(worker, cfg)
                joined = True
                await _leave(worker, cfg, loaded.close)
    except (NatsOrderedError, NatsError, TimeoutError) as exc:
        if not joined:
            raise  # before joining: a usage, configuration or connection error (exit 2)
        print_err(f"error: member {cfg.member_id}: {error_in_cli_terms(exc, args, options)}")
        return EXIT_FAILED
    if crashed:
        if isinstance(worker.error, GroupDeletedError | PermissionDenied):
            text = error_in_cli_terms(worker.error, args, options)
            print_err(f"error: member {cfg.member_id} stopped: {text}")
            return EXIT_FAILED
        print_err(
            f"error: member {cfg.member_id} stopped on an error (logged above) and left the "
            "group; its partitions move to the other members. Fix the cause and start it again"
        )
        return EXIT_FAILED
    return EXIT_OK


async def _run_member(worker: Worker, cfg: WorkerConfig) -> bool:
    """Join, then run until a signal (False) or until the member stops by itself (True)."""
    stop = asyncio.Event()
    received: list[int] = []

    def exit_now(sig: int, _frame: object = None) -> None:
        os._exit(EXIT_SIGTERM if sig == signal.SIGTERM else EXIT_SIGINT)

    def on_signal(sig: int) -> None:
        received.append(sig)
        if len(received) == 1:
            print_err(
                f"member {cfg.member_id}: stopping (finishing messages in hand, "
                "committing, releasing leases; signal again to exit at once)"
            )
            stop.set()
            # the second signal must work even if the event loop is blocked (say, in a
            # handler's close() waiting on a lock): a plain handler, not the loop's
            for s in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(s)
                    signal.signal(s, exit_now)
        else:
            exit_now(sig)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal, sig)
    _install_stack_dumps(loop)
    await worker.start()
    print_err(f"member {cfg.member_id} joined group {cfg.group} of {cfg.stream}")
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait(
        {waiter, asyncio.ensure_future(worker.stopped.wait())},
        return_when=asyncio.FIRST_COMPLETED,
    )
    return not stop.is_set()


async def _leave(worker: Worker, cfg: WorkerConfig, close: Any) -> None:
    """Leave gracefully, close the handler, print the member's summary."""
    await worker.stop()
    if close is not None:
        r = close()
        if inspect.isawaitable(r):
            await r
    st = worker.stats
    print_err(
        f"member {cfg.member_id} left: {st['processed']:,} messages processed, "
        f"{st['retries']} retries, {st['dead_lettered']} dead-lettered, "
        f"{st['fenced']} fenced, {st['leases_lost']} leases lost"
    )


COMMAND = Command(
    "worker",
    "run a member of a consumer group: owns partitions by lease, processes them in order",
    configure,
    run,
    "Members of a group share the stream's partitions and rebalance when members join, "
    "leave or die. SIGTERM/SIGINT: finish the message in hand, commit, release, leave and "
    "exit 0 (a graceful leave is a success); a second signal exits at once with 143 "
    "(SIGTERM) or 130 (SIGINT). Exit 2 only before the member joined (flags, handler, "
    "connection, stream, group settings: the message says what to fix); a member that "
    "stops on an error after joining exits 3, also when its group is deleted under it "
    "(`group delete --force`: it stops once, saying so, instead of retrying). "
    "--handler's module is looked up in the current directory first, as in `pool`. "
    "SIGUSR1 dumps every thread's stack to stderr, SIGUSR2 every asyncio task's.",
)
