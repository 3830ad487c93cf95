"""``nats-ordered status``: a group's owners, fencing tokens, committed positions and lag;
with ``--wait-drained``, wait until the group has processed everything published so far.

A wait never hangs on a group nobody consumes: with no live member for
``--no-members-timeout`` (default 60s) it exits 1, and a group that has no state yet (the
workers are starting), or a stream whose repartition has not recorded its switch point
(running, or interrupted: the message names the command that completes it), is waited for
within the same bound."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import signal
import sys
import time
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from airflow_nats_ordered.cli.common import (
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OK,
    Command,
    connected,
    format_duration,
    format_table,
    group_name,
    parse_duration,
    print_err,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.drain import DEFAULT_NO_MEMBERS_TIMEOUT, wait_drained
from airflow_nats_ordered.core.admin.drain_errors import (
    DrainTimeoutError,
    NoMembersError,
    PartitionBlockedError,
    RepartitionUnfinishedError,
    StrayMessagesError,
)
from airflow_nats_ordered.core.admin.marks import DrainProgress
from airflow_nats_ordered.core.admin.membership import group_exists
from airflow_nats_ordered.core.admin.overview import group_status
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError

#: seconds between two refreshes of ``status --watch``
WATCH_INTERVAL = 2.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument("--group", required=True, type=group_name, metavar="G", help="consumer group")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument(
        "--wait-drained",
        action="store_true",
        help="first wait until every partition's committed position reaches its last "
        "sequence as of now (progress on stderr), then show the status. A group with no "
        "state yet (workers still starting) is waited for. Exit 1 on --timeout or when no "
        "member is alive for --no-members-timeout (nobody consumes the group) or the "
        "stream's repartition stays unfinished that long, 3 as soon "
        "as a partition is blocked on a poison message or when the stream holds stray "
        "messages (on subjects no worker reads)",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="refresh every --interval until Ctrl-C (exit 0): in place on a terminal, "
        "repeated tables otherwise; with --json one JSON object per line",
    )
    p.add_argument(
        "--interval",
        type=parse_duration,
        metavar="DURATION",
        help=f"with --watch: time between refreshes (default {WATCH_INTERVAL:g}s)",
    )
    p.add_argument(
        "--timeout",
        type=parse_duration,
        metavar="DURATION",
        help="with --wait-drained: give up after this long, e.g. 90s, 10m (default: no limit)",
    )
    p.add_argument(
        "--no-members-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="with --wait-drained: exit 1 once no member of the group has been alive (or, "
        "for a group with no state yet, none has joined; or the stream's repartition has "
        "not recorded its switch point) for this long since the command "
        f"started; 0 waits anyway (default {DEFAULT_NO_MEMBERS_TIMEOUT:g}s: a pool restarts "
        "a crashed member well within it)",
    )


async def _read(nc: NATS, stream_name: str, group: str) -> dict[str, Any]:
    """The status as a JSON-safe dict (the ``--json`` output; the Airflow view shows the same)."""
    return await group_status(nc, stream_name, group)


def _print_table(out: dict[str, Any]) -> None:
    parts, members = out["partitions"], out["members"]
    print(
        format_table(
            ("partition", "owner", "token", "committed", "last", "lag", "blocked"),
            [
                (
                    p["partition"],
                    p["owner"],
                    p["fencing_token"],
                    p["committed"],
                    p["last"],
                    p["lag"],
                    p["blocked"],
                )
                for p in parts
            ],
            footer=[("total", "", "", "", "", out["total_lag"], "")],
        )
    )
    print()
    print(
        format_table(
            ("member", "host", "pid", "partitions", "heartbeat age"),
            [
                (
                    m["member"],
                    m["host"],
                    m["pid"],
                    len(m["partitions"]),
                    f"{m['heartbeat_age']:.1f}s",
                )
                for m in members
            ],
        )
        if members
        else "no live members"
    )
    glob = out.get("global_order")
    if glob:
        running = f"reader {glob['reader']} running" if glob["reader"] else "no reader running"
        if glob.get("error") and not glob["reader"]:
            running = "no reader running: the last one stopped on an error (see problems)"
        if glob["held_back_by"]:
            running += f", held back by producer(s) {', '.join(glob['held_back_by'])}"
        at = glob["position_time"] or f"{glob['position']:,}"
        print(
            f"global order: position {at} (token {glob['fencing_token']}, "
            f"written by {glob['member'] or '-'}), {glob['late']:,} late record(s), {running}"
        )
    dlq = out["dead_letters"]
    if dlq["exists"]:
        print(f"dead letters: {dlq['messages']:,} in stream {dlq['stream']} ({dlq['subjects']})")
    else:
        print(f"dead letters: none (stream {dlq['stream']} does not exist)")
    strays = out["strays"]
    if strays["messages"]:
        shown = ", ".join(f"{s} ({n})" for s, n in list(strays["subjects"].items())[:5])
        more = ", ..." if len(strays["subjects"]) > 5 else ""
        print(f"strays: {strays['messages']:,} never read by any worker: {shown}{more}")
    if out.get("epoch", 0) != out.get("stream_epoch", 0):
        print(
            f"layout: the stream was repartitioned (epoch {out['stream_epoch']}); the group "
            f"finishes the partitions of epoch {out['epoch']} (shown) before any record of a "
            f"later layout ({out['later_layout_messages']:,} waiting, counted in the lag)"
        )
    if out["problems"]:
        print("problems:")
        for problem in out["problems"]:
            print(f"  - {problem}")
    print(
        f"group {out['group']} of {out['stream']}: generation {out['generation'] or '-'}, "
        f"leader {out['leader'] or '-'}, {len(members)} member(s), "
        f"lag {out['total_lag']:,}{', drained' if out['drained'] else ''}"
    )


class _DrainProgressLine:
    """Progress of a wait on stderr: at most once a second, and when the wait ends."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.shown = 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, progress: DrainProgress) -> None:
        now = time.monotonic()
        if not progress.done and now - self.shown < 1.0:
            return
        self.shown = now
        if progress.group_missing and not progress.done:
            self._write(
                f"waiting for group {self.group} to appear: no worker has joined it yet "
                f"({format_duration(round(progress.elapsed))})",
                False,
            )
            return
        if progress.pending_switch is not None and not progress.done:
            self._write(
                f"waiting for group {self.group} to drain: the stream's repartition has not "
                f"recorded the switch point of layout epoch {progress.pending_switch} yet (a "
                "repartition running, or interrupted: `nats-ordered repartition` with the "
                "same count completes it) "
                f"({format_duration(round(progress.elapsed))})",
                False,
            )
            return
        behind = progress.behind
        at_mark = len(progress.marks) - len(behind)
        text = (
            f"waiting for group {self.group} to drain: {at_mark} of {len(progress.marks)} "
            f"partitions at their mark"
        )
        if behind:
            shown = ", ".join(f"{p} at {c} of {m}" for p, (c, m) in list(behind.items())[:4])
            text += f"; behind: partition {shown}{', ...' if len(behind) > 4 else ''}"
        text += f" ({format_duration(round(progress.elapsed))})"
        self._write(text, progress.done)

    def _write(self, text: str, last: bool) -> None:
        if self.tty:
            sys.stderr.write(f"\r{text}\x1b[K" + ("\n" if last else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


class _Screen:
    """Where ``--watch`` shows each refresh: redrawn in place on a terminal (cursor home,
    each line cleared to its end, the rest of the screen cleared: no flicker), one table
    after another otherwise, one JSON object per line with ``--json``."""

    def __init__(self, as_json: bool, interval: float) -> None:
        self.as_json = as_json
        self.interval = interval
        self.tty = sys.stdout.isatty() and not as_json

    def show(self, out: dict[str, Any] | None, error: str | None) -> None:
        if self.as_json:
            doc = {"ts": round(time.time(), 3), **(out or {})}
            if error is not None:
                doc["error"] = error
            sys.stdout.write(json.dumps(doc, default=str) + "\n")
            sys.stdout.flush()
            return
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            print(
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}, every "
                f"{format_duration(self.interval)} (Ctrl-C to stop)"
            )
            if error is not None:
                print(f"error: {error}")
            else:
                assert out is not None
                _print_table(out)
        text = buf.getvalue()
        if self.tty:
            lines = text.rstrip("\n").split("\n")
            text = "\x1b[H" + "".join(f"{line}\x1b[K\n" for line in lines) + "\x1b[J"
        else:
            text += "\n"
        sys.stdout.write(text)
        sys.stdout.flush()


async def _watch(nc: NATS, args: argparse.Namespace) -> int:
    """Show the status every ``--interval`` until SIGINT/SIGTERM. A read that fails (the
    server restarting, the group not created yet) is shown, and the watch goes on."""
    interval = args.interval if args.interval is not None else WATCH_INTERVAL
    screen = _Screen(args.json, interval)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            out, error = None, None
            try:
                out = await _read(nc, args.stream, args.group)
            except (NatsOrderedError, nats.errors.Error, TimeoutError) as exc:
                error = str(exc).strip() or type(exc).__name__
            screen.show(out, error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return EXIT_OK


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    if args.timeout is not None and not args.wait_drained:
        raise ConfigError("--timeout applies to --wait-drained; pass both, or neither")
    if args.no_members_timeout is not None and not args.wait_drained:
        raise ConfigError("--no-members-timeout applies to --wait-drained; pass both, or neither")
    if args.watch and args.wait_drained:
        raise ConfigError("--watch and --wait-drained do not combine; pass one of them")
    if args.interval is not None and not args.watch:
        raise ConfigError("--interval applies to --watch; pass both, or neither")
    if args.watch and args.interval == 0:
        raise ConfigError("--interval must be more than 0, e.g. 2s")
    if args.watch:  # a watch rides out server restarts: reconnect for as long as it takes
        options = dataclasses.replace(options, max_reconnect_attempts=-1)
    code, failure = EXIT_OK, None
    async with connected(options) as nc:
        if args.watch:
            return await _watch(nc, args)
        if args.wait_drained:
            timeout = args.timeout or None  # 0 / "unlimited": no limit
            no_members = args.no_members_timeout
            if no_members is None:
                no_members = DEFAULT_NO_MEMBERS_TIMEOUT
            try:
                await wait_drained(
                    nc,
                    args.stream,
                    args.group,
                    timeout=timeout,
                    no_members_timeout=no_members or None,  # 0: wait anyway
                    on_progress=_DrainProgressLine(args.group),
                )
            except DrainTimeoutError as exc:
                code = EXIT_INCOMPLETE
                failure = (
                    f"group {args.group} did not drain within {format_duration(timeout or 0)}: "
                    f"{len(exc.behind)} partition(s) behind (see the table); check that its "
                    "workers run and make progress, or raise --timeout"
                )
            except NoMembersError as exc:
                code = EXIT_INCOMPLETE
                failure = f"{exc} (or raise --no-members-timeout; 0 waits for them without limit)"
            except RepartitionUnfinishedError as exc:
                code = EXIT_INCOMPLETE
                failure = f"{exc}; or raise --no-members-timeout (0 waits for it without limit)"
            except StrayMessagesError as exc:
                code = EXIT_FAILED
                failure = str(exc)
            except PartitionBlockedError as exc:
                code = EXIT_FAILED
                failure = (
                    f"partition {exc.partition} is blocked on a poison message: {exc.reason}. "
                    "Fix the handler and restart the group's workers (the next owner retries "
                    "the message), or run them with --poison dead-letter to set it aside"
                )
        if failure is not None and not await group_exists(nc, args.stream, args.group):
            out = _no_state(args.stream, args.group, failure)
        else:
            out = await _read(nc, args.stream, args.group)
    if args.json:
        print_json(out)
    elif "partitions" in out:
        _print_table(out)
    if failure is not None:
        print_err(f"error: {failure}")
    return code


def _no_state(stream: str, group: str, failure: str) -> dict[str, Any]:
    """What ``--json`` prints when a wait ended before the group had any state: there is no
    table to show, only that nothing drained and why."""
    return {
        "stream": stream,
        "group": group,
        "exists": False,
        "drained": False,
        "problems": [failure],
    }


COMMAND = Command(
    "status",
    "show a group: owner, fencing token, committed position and lag per partition",
    configure,
    run,
    "Also its dead-letter stream and the problems an operator must act on. With "
    "--wait-drained it first waits (watching the group's commits, not polling) until every "
    "partition has processed what it held when the command started. With --watch it "
    "refreshes until Ctrl-C.",
)
