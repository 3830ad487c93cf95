"""``nats-ordered pool``: run and supervise N member processes of a group.

What a container or a systemd unit runs: N ``nats-ordered worker`` processes named
``<prefix>-1`` .. ``<prefix>-N``, each restarted when it exits, with exponential backoff.

Guarantees:

* A member that exits (crash, SIGKILL, error) while the pool runs is started again under
  the same id after ``--restart-backoff`` seconds, doubled on each further exit up to
  ``--restart-backoff-max``; a member that ran ``--restart-reset`` seconds or more before
  exiting starts again after the first delay. Every exit and restart is logged.
* SIGTERM/SIGINT to the pool: the signal is forwarded once to every member, which leaves
  gracefully (finishes the message in hand, commits, releases); nothing is restarted any
  more; the pool exits 0 when all have left with 0. A second signal is forwarded again
  (members exit at once) and the pool exits 143/130.
* Members run in their own session (a terminal's Ctrl-C reaches only the pool, which
  forwards one signal) and, on Linux, die with the pool (PR_SET_PDEATHSIG) even if the pool
  is SIGKILLed: a restarted pool never runs beside orphans using the same member ids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..core.connection import ConnectionOptions
from ..core.errors import ConfigError
from ..embedded_process import _die_with_parent_fn
from ..metrics import MemberEndpoint, MetricsServer, serve_pool
from .common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Command,
    add_connection_flags,
    format_duration,
    positive_float,
    positive_int,
    print_err,
)
from .worker import _worker_config, add_member_flags, add_metrics_flags


def _default_prefix() -> str:
    return socket.gethostname().split(".")[0] or "member"


def configure(p: argparse.ArgumentParser) -> None:
    add_member_flags(p)
    p.add_argument(
        "--size", type=positive_int, required=True, metavar="N", help="member processes to run"
    )
    p.add_argument(
        "--member-prefix",
        default=_default_prefix(),
        metavar="PREFIX",
        help="members are PREFIX-1 .. PREFIX-N; give each pool of a group its own prefix "
        "(default: the host name, %(default)s here)",
    )
    p.add_argument(
        "--restart-backoff",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="wait before restarting a member that exited; doubled on each further exit "
        "(default %(default)g)",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="the longest wait before a restart (default %(default)g)",
    )
    p.add_argument(
        "--restart-reset",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="a member that ran at least this long restarts after --restart-backoff again "
        "(default %(default)g)",
    )
    p.add_argument(
        "--stop-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT, SIGKILL members still running after this long (they "
        "are then counted as not having left; their leases expire after the TTL) "
        "(default %(default)g)",
    )
    add_metrics_flags(p, "all members'")


def member_argv(args: argparse.Namespace) -> list[str]:
    """The ``worker`` flags a member gets: every member and connection flag the pool was
    given (re-emitted from the parsed values, so defaults stay the worker's own)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_member_flags(probe)
    add_connection_flags(probe)
    out: list[str] = []
    for action in probe._actions:  # argparse has no public list of a parser's flags
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == action.default:
            continue
        flag = action.option_strings[-1] if action.dest == "verbose" else action.option_strings[0]
        if isinstance(action, argparse._CountAction):
            out += [flag] * value
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


@dataclass
class _Member:
    endpoint: MemberEndpoint
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    #: how it exited after the pool was told to stop (None: it was not running then)
    left_with: int | None = None


class Supervisor:
    """Keeps ``len(argvs)`` member processes running until :meth:`stop` (see the module
    docstring for the restart and stop guarantees)."""

    def __init__(
        self,
        members: dict[str, list[str]],
        *,
        backoff: float,
        backoff_max: float,
        reset_after: float,
        stop_timeout: float,
        metrics_port: int | None = None,
        log: Callable[[str], None] = print_err,
    ) -> None:
        self.members = [
            _Member(
                MemberEndpoint(
                    member,
                    f"http://127.0.0.1:{metrics_port + i}" if metrics_port is not None else "",
                ),
                argv,
            )
            for i, (member, argv) in enumerate(members.items(), start=1)
        ]
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.reset_after = reset_after
        self.stop_timeout = stop_timeout
        self.log = log
        self.stopping = asyncio.Event()

    def endpoints(self) -> list[MemberEndpoint]:
        return [m.endpoint for m in self.members]

    async def run(self) -> int:
        """Run until every member has exited after :meth:`stop`; the exit code: 0 when all
        left with 0, 1 otherwise."""
        keepers = [asyncio.ensure_future(self._keep(m)) for m in self.members]
        await self.stopping.wait()
        done, pending = await asyncio.wait(keepers, timeout=self.stop_timeout)
        if pending:
            for m in self.members:
                if m.endpoint.running and m.proc is not None:
                    self.log(
                        f"pool: member {m.endpoint.member} did not leave within "
                        f"{format_duration(self.stop_timeout)}; killing it"
                    )
                    with contextlib.suppress(ProcessLookupError):
                        m.proc.kill()
            await asyncio.wait(pending)
        failed = [
            f"{m.endpoint.member} ({_describe(m.left_with)})"
            for m in self.members
            if m.left_with not in (None, 0)
        ]
        if failed:
            self.log(f"pool: not every member left gracefully: {', '.join(failed)}")
            return EXIT_INCOMPLETE
        self.log(f"pool: all {len(self.members)} members left")
        return EXIT_OK

    def stop(self, sig: int) -> None:
        """Forward ``sig`` to every running member; the first call also ends restarts."""
        self.stopping.set()
        for m in self.members:
            if m.endpoint.running and m.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    m.proc.send_signal(sig)

    async def _keep(self, m: _Member) -> None:
        delay = self.backoff
        name = m.endpoint.member
        while not self.stopping.is_set():
            m.started = time.monotonic()
            try:
                m.proc = await asyncio.create_subprocess_exec(
                    *m.argv,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent_fn(),
                )
            except OSError as exc:
                code = -1
                self.log(f"pool: member {name} could not be started: {exc}")
            else:
                m.endpoint.running = True
                self.log(f"pool: member {name} started (pid {m.proc.pid})")
                try:
                    code = await m.proc.wait()
                finally:
                    m.endpoint.running = False
            if self.stopping.is_set():
                m.left_with = code
                return
            ran = time.monotonic() - m.started
            if ran >= self.reset_after:
                delay = self.backoff
            m.endpoint.restarts += 1
            self.log(
                f"pool: member {name} exited ({_describe(code)}) after "
                f"{format_duration(round(ran, 1))}; restarting it in {format_duration(delay)} "
                f"(restart {m.endpoint.restarts})"
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            delay = min(delay * 2, self.backoff_max)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    prefix = args.member_prefix
    ids = [f"{prefix}-{i}" for i in range(1, args.size + 1)]
    # the flags are checked once here, not N times in crash-looping members
    _worker_config(argparse.Namespace(**vars(args), member_id=ids[0]))
    if args.restart_backoff_max < args.restart_backoff:
        raise ConfigError("--restart-backoff-max must be >= --restart-backoff")
    base = [sys.executable, "-m", "airflow_nats_ordered.cli", "worker", *member_argv(args)]
    members = {}
    for i, member in enumerate(ids, start=1):
        argv = [*base, "--member-id", member]
        if args.metrics_port is not None:
            argv += ["--metrics-port", str(args.metrics_port + i), "--metrics-addr", "127.0.0.1"]
        members[member] = argv
    sup = Supervisor(
        members,
        backoff=args.restart_backoff,
        backoff_max=args.restart_backoff_max,
        reset_after=args.restart_reset,
        stop_timeout=args.stop_timeout,
        metrics_port=args.metrics_port,
    )
    server: MetricsServer | None = None
    if args.metrics_port is not None:
        try:
            server = serve_pool(sup.endpoints, args.metrics_port, args.metrics_addr)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_addr}:"
                f"{args.metrics_port} ({exc.strerror}); pick a free port (members use the "
                f"next {args.size} ports on 127.0.0.1)"
            ) from None
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        if len(received) == 1:
            print_err(
                f"pool: {signal.Signals(sig).name}: members are leaving (committing, "
                "releasing leases); signal again to make them exit at once"
            )
        sup.stop(sig)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    print_err(
        f"pool: running {args.size} members {ids[0]}..{ids[-1]} of group {args.group} "
        f"of {args.stream}"
        + (f"; metrics on {args.metrics_addr}:{args.metrics_port}" if server else "")
    )
    try:
        code = await sup.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if server is not None:
            server.close()
    if len(received) > 1:
        return EXIT_SIGTERM if received[-1] == signal.SIGTERM else EXIT_SIGINT
    return code


COMMAND = Command(
    "pool",
    "run and supervise N worker processes of a group (what a container or unit runs)",
    configure,
    run,
    "Members PREFIX-1..PREFIX-N are `nats-ordered worker` processes with the same flags; "
    "one that exits is restarted with exponential backoff (logged). SIGTERM/SIGINT is "
    "forwarded: every member leaves gracefully and the pool exits 0 when all left with 0, "
    "1 if some did not (an error, or killed after --stop-timeout); a second signal makes "
    "members exit at once and the pool exits 143 (SIGTERM) or 130 (SIGINT); 2 for a "
    "usage or connection error before any member starts. With --metrics-port P the pool "
    "serves every member's metrics merged, and a /healthz that is 200 only while every "
    "member runs and can renew its leases, on P; member i also serves its own on "
    "127.0.0.1:P+i.",
)
