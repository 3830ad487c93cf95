"""``nats-ordered pool``: run and supervise N member processes of a group.

What a container or a systemd unit runs: N ``nats-ordered worker`` processes named
``<prefix>-1`` .. ``<prefix>-N``, each restarted when it exits, with exponential backoff.

Guarantees:

* Nothing starts until the pool itself has checked, once, what every member would fail on
  at start-up: the flags, the handler (imported, callable or a class it can create; looked
  up in the current directory first, as members do), the connection, the stream and the
  group's settings (it opens the group as a member does). A failure exits 2 with the message
  a worker would print, and no member is started.
* A member that exits 2 (it could not start: a usage, configuration or connection error,
  see ``worker``) ``--max-start-failures`` times in a row stops the pool: the others leave
  gracefully and the pool exits 2 repeating that member's error. A start that failed while
  the pool itself cannot reach the server (an outage, a rolling restart) does not count:
  the member is restarted with backoff until the server answers again.
* A member that exits 3 (stopped on an error after joining) while its group no longer
  exists (``group delete --force``) is not restarted: that would begin the group afresh from
  the stream's first message. When no member is left running, the pool exits 3.
* A member that exits (crash, SIGKILL, error) while the pool runs is started again under
  the same id after ``--restart-backoff`` seconds, doubled on each further exit up to
  ``--restart-backoff-max``; a member that ran ``--restart-reset`` seconds or more before
  exiting starts again after the first delay. Every exit and restart is logged.
* SIGTERM/SIGINT to the pool: the signal is forwarded once to every member, which leaves
  gracefully (finishes the message in hand, commits, releases); nothing is restarted any
  more; the pool exits 0 when all have left with 0. A second signal is forwarded again
  (members exit at once) and the pool exits 143/130. A member still starting (not yet
  joined, holding nothing) exits 0 on SIGTERM too, and one the signal killed before it
  could (before its interpreter ran the start-up guard) counts as gracefully gone.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.errors import Error as NatsError

from airflow_nats_ordered.cli.common import (
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_USAGE,
    Command,
    add_connection_flags,
    connected,
    format_duration,
    non_negative_int,
    positive_float,
    positive_int,
    print_err,
)
from airflow_nats_ordered.cli.worker import _worker_config, add_member_flags, add_metrics_flags
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import AuthError, ConfigError, ConnectError, NatsOrderedError
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.worker.presence import GroupPresence
from airflow_nats_ordered.embedded.process import _die_with_parent_fn
from airflow_nats_ordered.members.handlers import check_handler, current_directory_first
from airflow_nats_ordered.members.metrics import MemberEndpoint, MetricsServer, serve_pool


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
    p.add_argument(
        "--max-start-failures",
        type=non_negative_int,
        default=3,
        metavar="N",
        help="stop the pool (exit 2, repeating the error) when a member could not start N "
        "times in a row (it exited 2: a usage, configuration or connection error); a start "
        "that failed while the pool cannot reach the server either (an outage) does not "
        "count; 0 restarts it for ever (default %(default)s)",
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
    #: the last ``error: ...`` line of its latest run
    last_error: str | None = None
    #: why it is not restarted any more (its group was deleted)
    retired: str | None = None
    #: its latest run logged that it joined the group
    joined: bool = False


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
        max_start_failures: int = 0,
        group_gone: Callable[[], Awaitable[str | None]] | None = None,
        server_down: Callable[[], Awaitable[str | None]] | None = None,
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
        #: a member that exits 2 this many times in a row stops the pool (0: never)
        self.max_start_failures = max_start_failures
        #: why the group is gone (None: it exists, or that could not be told), asked before
        #: restarting a member that exited 3
        self.group_gone = group_gone
        #: why the server cannot be reached now (None: it can, or that could not be told),
        #: asked before counting a member's exit 2 as a start failure
        self.server_down = server_down
        #: why the pool stopped by itself (a member could not start)
        self.failure: str | None = None
        self.stopping = asyncio.Event()
        #: the first signal :meth:`stop` forwarded
        self.stop_signal: int | None = None

    def endpoints(self) -> list[MemberEndpoint]:
        return [m.endpoint for m in self.members]

    async def run(self) -> int:
        """Run until every member has exited after :meth:`stop`; the exit code: 0 when all
        left with 0, 1 otherwise; 2 when a member could not start ``max_start_failures``
        times in a row (the pool stopped itself); 3 when every member stopped because the
        group was deleted (nothing left to run)."""
        keepers = [asyncio.ensure_future(self._keep(m)) for m in self.members]
        all_retired = asyncio.ensure_future(asyncio.wait(keepers))
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({all_retired, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not self.stopping.is_set():
            reasons = sorted({m.retired for m in self.members if m.retired})
            self.log(
                f"pool: no member left to run ({'; '.join(reasons)}); start the pool again "
                "to begin the group afresh"
            )
            return EXIT_FAILED
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
            if m.left_with not in (None, 0) and not self._left_while_starting(m)
        ]
        if self.failure is not None:
            self.log(f"error: {self.failure}")
            return EXIT_USAGE
        if failed:
            self.log(f"pool: not every member left gracefully: {', '.join(failed)}")
            return EXIT_INCOMPLETE
        self.log(f"pool: all {len(self.members)} members left")
        return EXIT_OK

    def _left_while_starting(self, m: _Member) -> bool:
        """A member the forwarded SIGTERM reached before it joined (before even its
        start-up guard, see ``startup_signals``) died by it holding nothing: a graceful
        leave, as the worker's own guard makes it later in its start."""
        return (
            self.stop_signal == signal.SIGTERM and m.left_with == -signal.SIGTERM and not m.joined
        )

    def stop(self, sig: int) -> None:
        """Forward ``sig`` to every running member; the first call also ends restarts."""
        if not self.stopping.is_set():
            self.stop_signal = sig
        self.stopping.set()
        for m in self.members:
            if m.endpoint.running and m.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    m.proc.send_signal(sig)

    async def _keep(self, m: _Member) -> None:
        delay = self.backoff
        name = m.endpoint.member
        start_failures = 0
        while not self.stopping.is_set():
            m.started = time.monotonic()
            m.last_error = None
            m.joined = False
            code = await self._run_once(m)
            if self.stopping.is_set():
                m.left_with = code
                return
            ran = time.monotonic() - m.started
            down = None
            if code == EXIT_USAGE and self.server_down is not None:
                down = await self.server_down()  # an outage passes: not the member's fault
            if down is not None:
                self.log(f"pool: member {name} could not start while {down}; not counted")
            start_failures = start_failures + 1 if code == EXIT_USAGE and down is None else 0
            if self.max_start_failures and start_failures >= self.max_start_failures:
                self.failure = (
                    f"member {name} could not start {start_failures} times in a row "
                    f"({_describe(code)}): {m.last_error or 'its output is above'}"
                )
                self.log(
                    f"pool: member {name} could not start {start_failures} times in a row; "
                    "stopping the pool"
                )
                self.stop(signal.SIGTERM)
                return
            if code == EXIT_FAILED and self.group_gone is not None:
                gone = await self.group_gone()
                if gone is not None and not self.stopping.is_set():
                    m.retired = gone
                    self.log(
                        f"pool: member {name} exited ({_describe(code)}): {gone}; not "
                        "restarting it (it would begin the group afresh from the stream's "
                        "first message)"
                    )
                    return
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

    async def _run_once(self, m: _Member) -> int:
        """Start the member, pass its output on (remembering its last error), wait for it."""
        name = m.endpoint.member
        try:
            m.proc = await asyncio.create_subprocess_exec(
                *m.argv,
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent_fn(),
                limit=1 << 20,
            )
        except OSError as exc:
            self.log(f"pool: member {name} could not be started: {exc}")
            return -1
        m.endpoint.running = True
        self.log(f"pool: member {name} started (pid {m.proc.pid})")
        assert m.proc.stderr is not None
        forward = asyncio.ensure_future(self._forward(m, m.proc.stderr))
        try:
            code = await m.proc.wait()
        finally:
            m.endpoint.running = False
        # its last lines (a process it started may keep the pipe open: not waited for long)
        await asyncio.wait({forward}, timeout=2.0)
        return code

    async def _forward(self, m: _Member, stream: asyncio.StreamReader) -> None:
        """The member's stderr, line by line, to the pool's log."""
        while True:
            try:
                data = await stream.readline()
            except ValueError:  # a line over the limit: pass on what is buffered
                data = await stream.read(1 << 20)
            if not data:
                return
            line = data.decode(errors="replace").rstrip("\n")
            if line.startswith("error: "):
                m.last_error = line[len("error: ") :]
            elif line.startswith(f"member {m.endpoint.member} joined group "):
                m.joined = True
            self.log(line)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    prefix = args.member_prefix
    ids = [f"{prefix}-{i}" for i in range(1, args.size + 1)]
    # what every member would fail on at start-up is checked once here, not N times in
    # crash-looping members: the flags, the handler, the connection, the stream, the group
    cfg = _worker_config(argparse.Namespace(**vars(args), member_id=ids[0]))
    if args.restart_backoff_max < args.restart_backoff:
        raise ConfigError("--restart-backoff-max must be >= --restart-backoff")
    current_directory_first()  # as members (python -m) look it up
    check_handler(args.handler, stream=args.stream, group=args.group)
    async with connected(options) as nc:
        await GroupStore.open(nc, cfg.group_config)  # as a member opens it (creates it)

    async def group_gone() -> str | None:
        try:
            async with connected(options) as nc:
                error = await GroupPresence(nc, cfg.group_config).check()
        except (NatsOrderedError, NatsError, TimeoutError, OSError):
            return None  # cannot tell: restart as usual
        return None if error is None else f"group {args.group} of {args.stream} was deleted"

    async def server_down() -> str | None:
        try:
            async with connected(options):
                return None
        except AuthError:
            return None  # it answers, and refuses: a start failure like any other
        except (ConnectError, NatsError, TimeoutError, OSError) as exc:
            return f"the server cannot be reached ({str(exc).split('. ')[0]})"

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
        max_start_failures=args.max_start_failures,
        group_gone=group_gone,
        server_down=server_down,
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
    "members exit at once and the pool exits 143 (SIGTERM) or 130 (SIGINT). Before "
    "starting any member the pool checks the flags, the handler, the connection, the "
    "stream and the group once, and exits 2 with the error a worker would print; it also "
    "exits 2 (repeating the error, the other members leaving gracefully) when a member "
    "could not start --max-start-failures times in a row. A member that stopped because "
    "its group was deleted (`group delete --force`) is not restarted, and the pool exits 3 "
    "when no member is left. --handler's module is looked up in the current directory "
    "first, as in `worker`. With --metrics-port P the pool "
    "serves every member's metrics merged, and a /healthz that is 200 only while every "
    "member runs and can renew its leases, on P; member i also serves its own on "
    "127.0.0.1:P+i.",
)
