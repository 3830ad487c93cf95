"""What every ``nats-ordered`` command shares: exit codes, value parsers, output helpers
(tables, JSON, durations, sizes), the connection flags and the :class:`Command` record.

Each command lives in its own module of this package and exposes ``COMMAND``; the package's
``__init__`` lists them in :data:`airflow_nats_ordered.cli.COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlsplit

from nats.aio.client import Client as NATS

from airflow_nats_ordered.cli.airflow_connection import airflow_connection_options
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.fields import _domain_name, _subject_prefix
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError, PermissionDenied, denial_in
from airflow_nats_ordered.core.stream.partitioned import STREAM_NAME_RULE, check_stream_name

#: Exit codes of every command (listed in ``nats-ordered --help`` by :data:`EXIT_CODES_HELP`).
EXIT_OK = 0
#: The command ran but did not get everything done, and says what is left: records were
#: refused or not stored (publish), the group did not drain in time (status
#: --wait-drained), the group still has live members (group delete without --force).
EXIT_INCOMPLETE = 1
#: Usage, configuration, input or connection errors: the message says what to fix.
EXIT_USAGE = 2
#: A runtime failure: a worker stopped on an error, a partition is blocked on a poison
#: message (status --wait-drained), or an unexpected error (with a traceback).
EXIT_FAILED = 3
#: Interrupted before finishing (publish: after flushing what was accepted; worker: a
#: second signal, exiting without the graceful leave).
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

EXIT_CODES_HELP = """exit codes:
  0    success (a worker or pool that left gracefully on SIGTERM/SIGINT exits 0 too)
  1    not everything done: records refused or not stored (publish), not drained
       before --timeout, or no live member (or the stream's repartition still
       unfinished) for --no-members-timeout (status --wait-drained), live
       members (group delete), members that did not leave gracefully after the
       signal (pool)
  2    usage, configuration, input or connection error, or a permission the server
       refused (the message says what to fix: the flag, the role)
  3    runtime failure: a worker stopped on an error, a partition blocked on a poison
       message (status --wait-drained), or an unexpected error
  130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM: publish after flushing what was
       accepted; worker and pool on a second signal, without the graceful leave"""


# ---------------------------------------------------------------------------- values


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_TOKEN = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNLIMITED = ("unlimited", "none", "forever", "off")


def parse_duration(text: str) -> float:
    """Seconds from ``"90s"``, ``"30m"``, ``"2h"``, ``"7d"``, ``"1h30m"``, ``"500ms"`` or
    ``"3600"``. ``"0"``/``"unlimited"``/``"none"`` give 0. Raises ArgumentTypeError."""
    t = text.strip().lower().replace(" ", "")
    if t in _UNLIMITED:
        return 0.0
    try:
        value = float(t)
    except ValueError:
        pos, value = 0, 0.0
        for m in _DURATION_TOKEN.finditer(t):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if pos != len(t) or not t:
            raise argparse.ArgumentTypeError(
                f"invalid duration {text!r}: use a number of seconds or a number with a unit "
                "(ms, s, m, h, d, w), e.g. 90s, 30m, 2h, 7d, 1h30m"
            ) from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: must be >= 0")
    return value


_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes from ``"10GB"``, ``"512MiB"``, ``"64k"`` or ``"1048576"``; ``"unlimited"`` or
    ``"-1"`` give -1. Units are powers of 1024 (KB = KiB), as in the ``nats`` CLI."""
    t = text.strip()
    if t.lower() in _UNLIMITED or t == "-1":
        return -1
    m = _SIZE_RE.match(t)
    if not m or (m.group(3).lower() == "i" and not m.group(2)):
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number of bytes or a number with a unit "
            "(KB, MB, GB, TB or KiB, MiB, GiB, TiB; powers of 1024), e.g. 512MiB, 10GB"
        )
    return int(float(m.group(1)) * 1024 ** _SIZE_POWERS[m.group(2).lower()])


def positive_size(text: str) -> int:
    """A size as :func:`parse_size` reads it, that must be a positive number of bytes."""
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a size > 0 such as 64MiB, got {text!r}")
    return value


def format_size(n: int) -> str:
    """Compact text of a byte count in powers of 1024: 67108864 -> ``64MiB``, 1536 ->
    ``1.5KiB``, 100 -> ``100B`` (what :func:`parse_size` reads back)."""
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:.4g}{unit}" if unit != "B" else f"{n}B"


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def partition_list(text: str) -> list[int]:
    """Partitions from ``"0,3-5"``: single numbers and inclusive ranges."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid partitions {text!r}: give numbers and ranges, e.g. 0,3-5"
            ) from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(
                f"invalid partitions {text!r}: a range goes from a lower to a higher number >= 0"
            )
        out.update(range(first, last + 1))
    return sorted(out)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


_GROUP_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # GroupConfig's rule (core/group/config.py)


def stream_name(text: str) -> str:
    """``--stream``'s value (argparse ``type=``): a name a partitioned stream can have,
    checked before connecting, so ``NOPE.X`` or ``'A B'`` is a usage error (exit 2) naming
    the flag and the allowed characters instead of a server error."""
    try:
        return check_stream_name(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a stream name: use {STREAM_NAME_RULE}"
        ) from None


def group_name(text: str) -> str:
    """``--group``'s value (argparse ``type=``): 1-64 letters, digits, '_' or '-' (a group
    names KV buckets and subject tokens), checked before connecting."""
    if not _GROUP_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a group name: use 1-64 letters, digits, '_' or '-' "
            "(no dots, spaces, wildcards or slashes)"
        )
    return text


def format_duration(seconds: float) -> str:
    """Compact text of a duration: 3600 -> ``1h``, 5400 -> ``1h30m``, 0.5 -> ``0.5s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    rest = int(round(seconds))
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(out)


def format_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    footer: Iterable[Sequence[Any]] = (),
    gap: int = 2,
) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned, ``None`` as ``-``.

    ``footer`` rows (totals) are set off by a rule. Returns the text without a final newline.
    """
    body = [list(r) for r in rows]
    tail = [list(r) for r in footer]
    everything = body + tail
    ncols = len(headers)
    for r in everything:
        if len(r) != ncols:
            raise ValueError(f"row {r!r} has {len(r)} cells, the header has {ncols}")

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.1f}"
        return str(v)

    # a column is numeric by its body rows; footer cells (e.g. "total") follow its alignment
    numeric = [
        all(isinstance(r[i], int | float) or r[i] is None for r in body)
        and any(isinstance(r[i], int | float) for r in body)
        for i in range(ncols)
    ]
    text_rows = [[cell(v) for v in r] for r in everything]
    widths = [max([len(headers[i])] + [len(r[i]) for r in text_rows]) for i in range(ncols)]
    sep = " " * gap

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return sep.join(out).rstrip()

    lines = [line(list(headers))]
    lines += [line(r) for r in text_rows[: len(body)]]
    if tail:
        lines.append(sep.join("-" * w for w in widths))
        lines += [line(r) for r in text_rows[len(body) :]]
    return "\n".join(lines)


def print_json(obj: Any, out: IO[str] | None = None) -> None:
    print(json.dumps(obj, indent=2, default=str), file=out or sys.stdout)


def print_err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- connection


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "connection",
        "Flags override the NATS_* environment variables. Secrets are read from the "
        "environment or files only: NATS_PASSWORD, NATS_TOKEN, --creds/NATS_CREDS, "
        "--nkey/NATS_NKEY.",
    )
    g.add_argument(
        "--server",
        "-s",
        action="append",
        metavar="URL",
        help="NATS server URL; repeat or give a comma list for a cluster "
        "(default: $NATS_URL, else nats://127.0.0.1:4222). No credentials in it "
        "(user:password@ or token@ is refused): use NATS_USER/NATS_PASSWORD or NATS_TOKEN; "
        "$NATS_URL may carry them",
    )
    g.add_argument("--creds", metavar="FILE", help="NATS credentials (.creds) file [NATS_CREDS]")
    g.add_argument("--nkey", metavar="FILE", help="file holding an nkey user seed [NATS_NKEY]")
    g.add_argument(
        "--user",
        metavar="NAME",
        help="user name; the password is read from $NATS_PASSWORD [NATS_USER]",
    )
    g.add_argument("--tls-ca", metavar="FILE", help="CA certificate to trust (PEM) [NATS_CA]")
    g.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM) [NATS_CERT]")
    g.add_argument("--tls-key", metavar="FILE", help="client certificate key (PEM) [NATS_KEY]")
    g.add_argument(
        "--connect-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="give up connecting after this long (default 5)",
    )
    g.add_argument(
        "--inbox-prefix",
        type=_inbox_prefix,
        metavar="PREFIX",
        help="reply inbox prefix instead of _INBOX, for a user allowed to subscribe only to "
        "PREFIX.> (as the nats CLI's --inbox-prefix) [NATS_INBOX_PREFIX]",
    )
    api = g.add_mutually_exclusive_group()
    api.add_argument(
        "--js-domain",
        type=_js_domain,
        metavar="DOMAIN",
        help="the JetStream domain to use, e.g. a leaf node's (API prefix $JS.DOMAIN.API; "
        "streams and the group's KV buckets live there) [NATS_JS_DOMAIN]",
    )
    api.add_argument(
        "--js-api-prefix",
        type=_js_api_prefix,
        metavar="PREFIX",
        help="the JetStream API's subject prefix instead of $JS.API (an API imported from "
        "another account); not with --js-domain [NATS_JS_API_PREFIX]",
    )
    g.add_argument(
        "--conn-id",
        metavar="ID",
        help="take every connection setting from this Airflow connection of type nats (looked "
        "up as Airflow does: AIRFLOW_CONN_<ID> variables, secrets backends, its database); "
        "needs Airflow installed; not combinable with the flags above",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (repeat for debug logs)"
    )


def _flag_value(check: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse ``type=`` from a ConnectionOptions value check: argparse names the flag,
    the message says what is wrong (without the option's own name)."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ConfigError as exc:
            field = getattr(exc, "field", "")
            message = str(exc)
            if field and message.startswith(f"{field} "):
                message = message[len(field) + 1 :]
            raise argparse.ArgumentTypeError(message) from None

    return parse


_inbox_prefix = _flag_value(
    lambda t: _subject_prefix("inbox_prefix", t, example="--inbox-prefix _INBOX_ORDERS")
)
_js_domain = _flag_value(lambda t: _domain_name("js_domain", t))
_js_api_prefix = _flag_value(
    lambda t: _subject_prefix("js_api_prefix", t, example="--js-api-prefix JS.hub.API")
)


def connection_options(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ConnectionOptions:
    """The one place CLI flags become :class:`ConnectionOptions`: the environment, then flags.

    ``--user`` takes its password from ``$NATS_PASSWORD`` (never from the command line).
    ``--conn-id`` takes everything from an Airflow connection instead (and ignores the
    ``NATS_*`` variables). Raises ConfigError naming the flag or variable that is wrong.
    """
    env = os.environ if env is None else env
    if getattr(args, "conn_id", None):
        return airflow_connection_options(args)
    servers: tuple[str, ...] | None = None
    if args.server:
        servers = tuple(s.strip() for v in args.server for s in v.split(",") if s.strip())
        if not servers:
            raise ConfigError("--server is empty; give a URL such as nats://127.0.0.1:4222")
        for server in servers:
            _refuse_url_credentials(server)
    overrides: dict[str, Any] = {
        "servers": servers,
        "creds_file": args.creds,
        "nkey_seed_file": args.nkey,
        "tls_ca_file": args.tls_ca,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
        "connect_timeout": args.connect_timeout,
        "inbox_prefix": getattr(args, "inbox_prefix", None),
        "js_domain": getattr(args, "js_domain", None),
        "js_api_prefix": getattr(args, "js_api_prefix", None),
    }
    if args.user is not None:
        password = env.get("NATS_PASSWORD") or None
        if password is None:
            raise ConfigError(
                f"--user {args.user} needs a password in the environment variable "
                "NATS_PASSWORD (passwords are never taken from the command line)"
            )
        overrides["user"] = args.user
        overrides["password"] = password
    return ConnectionOptions.from_env(env, **overrides)


def _refuse_url_credentials(server: str) -> None:
    """A ``--server`` URL with ``user:password@`` or ``token@`` is refused (ConfigError, the
    secret not repeated): secrets never go on command lines, where ``ps`` shows them to
    every user of the host. ``NATS_URL`` may carry them: the environment is not shown."""
    raw = server if "://" in server else f"nats://{server}"
    try:
        netloc = urlsplit(raw).netloc
    except ValueError:
        return  # not a URL: ConnectionOptions says what is wrong with it
    if "@" not in netloc:
        return
    userinfo, host = netloc.rsplit("@", 1)
    scheme = raw.split("://", 1)[0]
    where = (
        "the environment variables NATS_USER and NATS_PASSWORD (or --user NAME and NATS_PASSWORD)"
        if ":" in userinfo
        else "the environment variable NATS_TOKEN"
    )
    raise ConfigError(
        f"--server {scheme}://***@{host} carries credentials, and secrets never go on the "
        "command line (ps shows it to every user of the host): pass --server "
        f"{scheme}://{host} and put them in {where}; NATS_URL may carry them too"
    )


def _inbox_refused(nc: NATS, options: ConnectionOptions) -> ConfigError | None:
    """Why a request timed out, when the server had refused the client's reply
    subscription (a user not allowed to subscribe to ``_INBOX.>``): the flag to pass."""
    refused = str(getattr(nc, "last_error", None) or "").removeprefix("nats: ")
    if "permissions violation for subscription" not in refused.lower():
        return None
    now = f" (now {options.inbox_prefix})" if options.inbox_prefix else ""
    return ConfigError(
        f"the server refused the subscription to this client's reply subjects ({refused}), "
        f"so its requests got no answer: pass --inbox-prefix PREFIX{now} (or set "
        "NATS_INBOX_PREFIX; with --conn-id, the connection's extra inbox_prefix) with a "
        "prefix whose subjects PREFIX.> the user may subscribe to"
    )


#: the role (of ``nats-ordered permissions``) a command acts in; every other: operator (but
#: ``status --group G``, the drain sensor's read: watcher)
COMMAND_ROLES: Mapping[str, str] = {
    "publish": "publisher",
    "worker": "worker",
    "pool": "worker",
    "global-read": "reader",
}


def _credentials_in_cli_terms(args: argparse.Namespace, options: ConnectionOptions) -> str:
    """Who the command connected as, named by the flag (and variable) that gave it."""
    conn_id = getattr(args, "conn_id", None)
    if conn_id:
        return (
            f"the user of Airflow connection {conn_id!r} given by --conn-id (its Login, or "
            "its extra creds_secret / creds_file / nkey_seed_secret / nkey_seed_file)"
        )
    method = options.auth_method
    if method == "user/password":
        return f"the user given by --user {options.user} (NATS_USER)"
    if method == "creds":
        return f"the user given by --creds {options.creds_file} (NATS_CREDS)"
    if method == "nkey":
        seed_file = f" {options.nkey_seed_file}" if options.nkey_seed_file else ""
        return f"the user given by --nkey{seed_file} (NATS_NKEY)"
    if method == "token":
        return "the user given by NATS_TOKEN"
    return "the server's default user (no --user, --creds, --nkey or NATS_TOKEN given)"


def denial_in_cli_terms(
    exc: BaseException, args: argparse.Namespace, options: ConnectionOptions
) -> str | None:
    """A :class:`PermissionDenied` behind ``exc`` in the CLI's terms: the refused
    permission, the flag that gave the user, the role the command acts in and the command
    that prints that role's permissions. None if no permission was refused."""
    denied: PermissionDenied | None = denial_in(exc)
    if denied is None:
        return None
    command = getattr(args, "command", "") or ""
    group = getattr(args, "group", None)
    role = COMMAND_ROLES.get(command, "operator")
    if command == "status" and group:
        role = "watcher"  # one group's status (and --wait-drained) is the drain sensor's read
    stream = getattr(args, "stream", None) or "STREAM"
    cmd = f"nats-ordered permissions --role {role} --stream {stream}"
    if group and role != "publisher":
        cmd += f" --group {group}"
    fix = (
        f"the {role} role needs it: run `{cmd}` and grant that user what it prints (or "
        "connect as a user that has it)"
    )
    if denied.reply_inbox:
        fix += (
            "; or pass --inbox-prefix PREFIX (NATS_INBOX_PREFIX; with --conn-id, the "
            "connection's extra inbox_prefix) with a prefix whose PREFIX.> that user may "
            "subscribe to"
        )
    return denied.message_for(_credentials_in_cli_terms(args, options), fix)


def error_in_cli_terms(
    exc: BaseException, args: argparse.Namespace, options: ConnectionOptions
) -> str:
    """``exc``'s message, a refused permission in the CLI's terms (see
    :func:`denial_in_cli_terms`)."""
    return denial_in_cli_terms(exc, args, options) or str(exc)


@contextlib.asynccontextmanager
async def connected(options: ConnectionOptions) -> AsyncIterator[NATS]:
    """A client connected with ``options``, closed on exit. A request that timed out because
    the server refused the reply subscription becomes a ConfigError naming --inbox-prefix."""
    nc = await connect(options)
    try:
        yield nc
    except TimeoutError:
        refused = _inbox_refused(nc, options)
        if refused is not None:
            raise refused from None
        raise
    finally:
        # connect()'s disconnected callback logs "reconnecting" on a deliberate close too;
        # keep that false alarm out of the CLI's output
        conn_log = logging.getLogger("airflow_nats_ordered.core.connection.connect")
        level = conn_log.level
        conn_log.setLevel(logging.ERROR)
        try:
            with contextlib.suppress(Exception):
                await nc.close()
        finally:
            conn_log.setLevel(level)


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """One subcommand: its flags (``configure``) and its body (``run``, returns the exit code)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, ConnectionOptions], Coroutine[Any, Any, int]]
    description: str = ""
    #: False for a command whose ``configure`` adds the connection flags itself (to each of
    #: its own subcommands: argparse reads a parser's flags only before its subcommand)
    connection_flags: bool = True
    #: False for a command that never connects (``permissions``): no connection flags, and
    #: no connection settings read from the flags or the environment
    connects: bool = True
