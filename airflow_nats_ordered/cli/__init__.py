"""``nats-ordered``: provision partitioned streams, publish files into them, inspect them.

Usage (``nats-ordered COMMAND --help`` for every flag)::

    nats-ordered provision --stream ORDERS --partitions 16 [--max-age 7d] [--json]
    nats-ordered repartition --stream ORDERS --partitions 32 [--json]
    nats-ordered publish --stream ORDERS orders.jsonl --key-field customer \\
        [--order-by ts] [--msg-id-field id] [--json]
    nats-ordered info --stream ORDERS [--json]
    nats-ordered worker --stream ORDERS --group billing --handler mypkg.handlers:apply \\
        [--conn-id nats_default] [--metrics-port 9108]
    nats-ordered pool --size 3 --stream ORDERS --group billing --handler mypkg.handlers:apply
    nats-ordered status --stream ORDERS --group billing [--wait-drained [--timeout 10m]]
    nats-ordered status --stream ORDERS --group billing --watch [--interval 2s]
    nats-ordered group delete --stream ORDERS --group billing [--force] [--dead-letters]
    nats-ordered group list [--stream ORDERS] [--json]
    nats-ordered group describe --stream ORDERS --group billing     # = status
    nats-ordered group reset --stream ORDERS --group billing --to earliest|latest|seq:N|time:T \\
        [--partitions 0,3-5] [--dry-run | --execute]
    nats-ordered group rebalance --stream ORDERS --group billing [--cordon m1,m2] [--by-load]
    nats-ordered dead-letters list|show SEQ|replay|purge --stream ORDERS --group billing
    nats-ordered global-read --stream LEDGER --group audit --handler mypkg.handlers:apply \\
        [--order-by sequence|time|event-time [--watermarks]]
    nats-ordered global-producers --stream LEDGER [--close PRODUCER] [--json]
    nats-ordered permissions --role worker --stream ORDERS --group billing  # never connects

Every command takes the connection flags (``--server``, ``--creds``, ``--nkey``, ``--user``,
``--tls-ca``/``--tls-cert``/``--tls-key``, ``--connect-timeout``) on top of the ``nats`` CLI
environment variables (``NATS_URL``, ``NATS_USER``, ``NATS_PASSWORD``, ``NATS_TOKEN``,
``NATS_CREDS``, ``NATS_NKEY``, ``NATS_CA``, ``NATS_CERT``, ``NATS_KEY``), or
``--conn-id ID`` to take them all from an Airflow connection of type ``nats``. Secrets
(passwords, tokens, nkey seeds) are never taken from the command line: a password comes
from ``$NATS_PASSWORD``, a token from ``$NATS_TOKEN``, seeds from files.

Exit codes (:data:`.common.EXIT_CODES_HELP`, shown by ``--help``): 0 success, including a
worker or pool that left gracefully on SIGTERM/SIGINT; 1 not everything done (records refused
or not stored, not drained in time, a group with live members, pool members that did not
leave gracefully); 2 usage, configuration, input or connection errors, and permissions
the server refused (the message names the flag that gave the user and the role the command
needs: ``nats-ordered permissions --role ...``); 3 runtime failures (a worker stopped on an
error, a blocked partition, an unexpected error); 130/143 interrupted by SIGINT/SIGTERM
(publish, after flushing what was accepted; worker and pool, on a second signal without the
graceful leave).

Adding a command: a module ``cli/x.py`` with ``configure(parser)``, ``async def run(args,
options) -> int`` and ``COMMAND = Command("x", ...)``, listed in :data:`COMMANDS`.
"""

from __future__ import annotations

import sys

from airflow_nats_ordered.cli import startup_signals

# first, before the heavy imports below: a worker or pool SIGTERM'd while it starts exits 0
if startup_signals.is_member_program(sys.argv):
    startup_signals.guard()

import argparse
import asyncio
import contextlib
import logging
import os
import traceback
from collections.abc import Sequence

import nats.errors
import nats.js.errors

from airflow_nats_ordered.cli import (
    dead_letters,
    global_producers,
    global_read,
    group,
    info,
    permissions,
    pool,
    provision,
    publish,
    repartition,
    status,
    worker,
)
from airflow_nats_ordered.cli.common import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_USAGE,
    Command,
    add_connection_flags,
    connection_options,
    denial_in_cli_terms,
    print_err,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import NatsOrderedError

__all__ = [
    "COMMANDS",
    "build_parser",
    "main",
]

COMMANDS: list[Command] = [
    provision.COMMAND,
    repartition.COMMAND,
    publish.COMMAND,
    worker.COMMAND,
    pool.COMMAND,
    status.COMMAND,
    info.COMMAND,
    group.COMMAND,
    dead_letters.COMMAND,
    global_read.COMMAND,
    global_producers.COMMAND,
    permissions.COMMAND,
]


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions as usual but keeps text that has its own line breaks (the exit
    code table of the epilog) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nats-ordered",
        description="Kafka-like per-key ordered event pipelines on NATS JetStream.",
        epilog="Run `nats-ordered COMMAND --help` for the flags of a command.\n\n"
        + EXIT_CODES_HELP,
        formatter_class=_HelpFormatter,
    )
    try:
        from importlib.metadata import version

        parser.add_argument(
            "--version", action="version", version=f"%(prog)s {version('airflow-nats-ordered')}"
        )
    except Exception:  # pragma: no cover - not installed as a distribution
        pass
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(
            cmd.name,
            help=cmd.help,
            description=f"{cmd.help[0].upper()}{cmd.help[1:]}. {cmd.description}".strip(),
            epilog=EXIT_CODES_HELP,
            formatter_class=_HelpFormatter,
        )
        cmd.configure(p)
        if cmd.connection_flags and cmd.connects:
            add_connection_flags(p)
        p.set_defaults(_command=cmd)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced, e.g. in tests)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _setup_logging(verbosity: int) -> None:
    """Show this package's warnings (with ``-v`` info, ``-vv`` debug) on stderr.

    Only the ``airflow_nats_ordered`` logger gets a handler; records still propagate, and
    its level is only lowered (never raised) so an embedding program's setup keeps working.
    """
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logger = logging.getLogger("airflow_nats_ordered")
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    handler.setLevel(level)
    if level < logger.getEffectiveLevel():
        logger.setLevel(level)


def _nats_error_text(exc: BaseException) -> str:
    """A message for a NATS request that failed after connecting."""
    if isinstance(exc, nats.js.errors.ServiceUnavailableError | nats.errors.NoRespondersError):
        return (
            "JetStream is not available on the server: enable it (`nats-server -js` or a "
            "jetstream {} block in the server config) or give this account JetStream access"
        )
    if isinstance(exc, nats.js.errors.APIError):
        return f"the JetStream API refused the request: {exc.description} (code {exc.err_code})"
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return (
            "the NATS server did not answer a JetStream request in time; check the server is "
            "healthy and JetStream is enabled (retry when a cluster has elected its leaders)"
        )
    return f"NATS request failed: {str(exc).strip() or type(exc).__name__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nats-ordered`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _setup_logging(args.verbose)
    cmd: Command = args._command
    options = None
    try:
        try:
            options = connection_options(args) if cmd.connects else ConnectionOptions()
            return asyncio.run(cmd.run(args, options))
        except Exception as exc:
            denied = None if options is None else denial_in_cli_terms(exc, args, options)
            if denied is None:
                raise
            print_err(f"error: {denied}")  # a refused permission: configuration (exit 2)
            return EXIT_USAGE
    except NatsOrderedError as exc:
        print_err(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        print_err("interrupted")
        return EXIT_SIGINT
    except (nats.errors.Error, TimeoutError) as exc:
        print_err(f"error: {_nats_error_text(exc)}")
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `nats-ordered info ... | head`
        with contextlib.suppress(Exception):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the exit flush
        return EXIT_OK
    except Exception:  # a bug: keep its traceback, and an exit code of its own
        traceback.print_exc()
        print_err("error: unexpected failure (above); please report it with the command line")
        return EXIT_FAILED
