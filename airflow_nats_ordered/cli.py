"""``nats-ordered``: provision partitioned streams, publish files into them, inspect them.

Usage (``nats-ordered COMMAND --help`` for every flag)::

    nats-ordered provision --stream ORDERS --partitions 16 [--max-age 7d] [--json]
    nats-ordered publish --stream ORDERS orders.jsonl --key-field customer \\
        [--order-by ts] [--msg-id-field id] [--json]
    nats-ordered info --stream ORDERS [--json]

Every command takes the connection flags (``--server``, ``--creds``, ``--nkey``, ``--user``,
``--tls-ca``/``--tls-cert``/``--tls-key``, ``--connect-timeout``) on top of the ``nats`` CLI
environment variables (``NATS_URL``, ``NATS_USER``, ``NATS_PASSWORD``, ``NATS_TOKEN``,
``NATS_CREDS``, ``NATS_NKEY``, ``NATS_CA``, ``NATS_CERT``, ``NATS_KEY``). Secrets
(passwords, tokens, nkey seeds) are never taken from the command line: a password comes
from ``$NATS_PASSWORD``, a token from ``$NATS_TOKEN``, seeds from files.

Exit codes: 0 success; 1 records were refused or could not be stored (the summary says
which); 2 usage, configuration, input or connection errors (the message says what to fix);
130 interrupted by Ctrl-C (143 by SIGTERM) after flushing what had been accepted.

Adding a command: write ``_configure_x(parser)`` and ``async def _run_x(args, options) ->
int`` and list them in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import inspect
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from .core.assignor import Assignment
from .core.connection import ConnectionOptions, connect
from .core.errors import (
    ConfigError,
    InvalidKeyError,
    InvalidMsgIdError,
    MissingKeyError,
    NatsOrderedError,
    RecordTooLargeError,
    StreamNotFoundError,
)
from .core.group import GroupStore
from .core.publisher import OrderedPublisher, PublishError, PublishSummary
from .core.streams import (
    DEFAULT_DUPLICATE_WINDOW,
    PartitionedStream,
    ProvisionResult,
    StreamSpec,
    describe,
    partition_stats,
    provision,
)
from .core.worker import Worker, WorkerConfig
from .handlers import load_handler
from .inputs import FORMATS, InputError, InputRecord, open_records

__all__ = [
    "COMMANDS",
    "Command",
    "build_parser",
    "connection_options",
    "format_duration",
    "format_table",
    "main",
    "parse_duration",
    "parse_size",
]

log = logging.getLogger("airflow_nats_ordered.cli")

EXIT_OK = 0
EXIT_RECORDS = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

#: How many refused records are listed (with where and key) in the output.
REFUSED_EXAMPLES = 5


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


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


def _print_json(obj: Any, out: IO[str] | None = None) -> None:
    print(json.dumps(obj, indent=2, default=str), file=out or sys.stdout)


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- connection


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
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
        "(default: $NATS_URL, else nats://127.0.0.1:4222)",
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
        type=_positive_float,
        metavar="SECONDS",
        help="give up connecting after this long (default 5)",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (repeat for debug logs)"
    )


def connection_options(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ConnectionOptions:
    """The one place CLI flags become :class:`ConnectionOptions`: the environment, then flags.

    ``--user`` takes its password from ``$NATS_PASSWORD`` (never from the command line).
    Raises ConfigError naming the flag or variable that is wrong.
    """
    env = os.environ if env is None else env
    servers: tuple[str, ...] | None = None
    if args.server:
        servers = tuple(s.strip() for v in args.server for s in v.split(",") if s.strip())
        if not servers:
            raise ConfigError("--server is empty; give a URL such as nats://127.0.0.1:4222")
    overrides: dict[str, Any] = {
        "servers": servers,
        "creds_file": args.creds,
        "nkey_seed_file": args.nkey,
        "tls_ca_file": args.tls_ca,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
        "connect_timeout": args.connect_timeout,
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


@contextlib.asynccontextmanager
async def _connected(options: ConnectionOptions) -> AsyncIterator[NATS]:
    nc = await connect(options)
    try:
        yield nc
    finally:
        # connect()'s disconnected callback logs "reconnecting" on a deliberate close too;
        # keep that false alarm out of the CLI's output
        conn_log = logging.getLogger("airflow_nats_ordered.core.connection")
        level = conn_log.level
        conn_log.setLevel(logging.ERROR)
        try:
            with contextlib.suppress(Exception):
                await nc.close()
        finally:
            conn_log.setLevel(level)


# ---------------------------------------------------------------------------- provision


def _configure_provision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="stream name")
    p.add_argument(
        "--partitions",
        required=True,
        type=_positive_int,
        metavar="N",
        help="number of partitions; cannot change once the stream exists",
    )
    p.add_argument(
        "--subject-prefix",
        metavar="P",
        help="subjects are P.p.<n> (default: the stream name in lower case)",
    )
    p.add_argument("--replicas", type=_positive_int, metavar="R", help="replicas (default 1)")
    p.add_argument("--storage", choices=("file", "memory"), help="storage (default file)")
    p.add_argument(
        "--max-age",
        type=parse_duration,
        metavar="DURATION",
        help="drop messages older than this, e.g. 7d ('unlimited' to clear; default unlimited)",
    )
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        metavar="SIZE",
        help="keep at most this many bytes, e.g. 10GB ('unlimited' to clear)",
    )
    p.add_argument(
        "--max-msgs",
        type=int,
        metavar="N",
        help="keep at most N messages (-1 for unlimited)",
    )
    p.add_argument(
        "--max-msg-size",
        type=parse_size,
        metavar="SIZE",
        help="refuse messages larger than this ('unlimited' to clear)",
    )
    p.add_argument(
        "--duplicate-window",
        type=parse_duration,
        metavar="DURATION",
        help="how long a retried or rerun publish is still de-duplicated by msg-id; longer "
        f"than your slowest rerun (default {format_duration(DEFAULT_DUPLICATE_WINDOW)})",
    )
    p.add_argument("--description", metavar="TEXT", help="stream description")
    p.add_argument("--json", action="store_true", help="print the result as a JSON object")


def _keep(given: Any, current: Any, default: Any) -> Any:
    if given is not None:
        return given
    return current if current is not None else default


def _limit(given: int | float | None, current: int | float | None) -> int | float | None:
    """A retention limit: given (0/-1 = unlimited), else the stream's current one, else none."""
    value = given if given is not None else current
    if value is None or value <= 0:
        return None
    return value


def _spec_from_args(args: argparse.Namespace, current: PartitionedStream | None) -> StreamSpec:
    cfg = current.config if current is not None else None
    return StreamSpec(
        name=args.stream,
        partitions=args.partitions,
        subject_prefix=_keep(args.subject_prefix, current and current.prefix, None),
        replicas=_keep(args.replicas, current and current.replicas, 1),
        storage=_keep(args.storage, current and current.storage, "file"),
        max_age=_limit(args.max_age, cfg and cfg.max_age),
        max_bytes=_limit(args.max_bytes, cfg and cfg.max_bytes),  # type: ignore[arg-type]
        max_msgs=_limit(args.max_msgs, cfg and cfg.max_msgs),  # type: ignore[arg-type]
        max_msg_size=_limit(args.max_msg_size, cfg and cfg.max_msg_size),  # type: ignore[arg-type]
        duplicate_window=_keep(
            args.duplicate_window,
            current and current.duplicate_window,
            DEFAULT_DUPLICATE_WINDOW,
        ),
        description=_keep(args.description, cfg and cfg.description, None),
    )


def _stream_facts(stream: PartitionedStream) -> dict[str, Any]:
    cfg = stream.config
    return {
        "stream": stream.name,
        "partitions": stream.partitions,
        "prefix": stream.prefix,
        "subjects": list(cfg.subjects or []),
        "hash": stream.hash_name,
        "seed": stream.seed,
        "storage": stream.storage,
        "replicas": stream.replicas,
        "duplicate_window": stream.duplicate_window,
        "max_age": cfg.max_age or None,
        "max_bytes": cfg.max_bytes if cfg.max_bytes and cfg.max_bytes > 0 else None,
        "max_msgs": cfg.max_msgs if cfg.max_msgs and cfg.max_msgs > 0 else None,
        "max_msg_size": stream.max_msg_size if stream.max_msg_size > 0 else None,
    }


def _describe_stream(stream: PartitionedStream) -> str:
    cfg = stream.config
    bits = [
        f"{stream.partitions} partitions on {stream.prefix}.p.*",
        f"{stream.storage} storage",
        f"{stream.replicas} replica{'s' if stream.replicas != 1 else ''}",
        f"duplicate window {format_duration(stream.duplicate_window)}",
    ]
    if cfg.max_age:
        bits.append(f"max age {format_duration(cfg.max_age)}")
    if cfg.max_bytes and cfg.max_bytes > 0:
        bits.append(f"max bytes {cfg.max_bytes}")
    if cfg.max_msgs and cfg.max_msgs > 0:
        bits.append(f"max msgs {cfg.max_msgs}")
    if stream.max_msg_size > 0:
        bits.append(f"max msg size {stream.max_msg_size}")
    return ", ".join(bits)


async def _run_provision(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with _connected(options) as nc:
        try:
            current: PartitionedStream | None = await describe(nc, args.stream)
        except StreamNotFoundError:
            current = None
        spec = _spec_from_args(args, current)
        result: ProvisionResult = await provision(nc, spec)
    s = result.stream
    if args.json:
        _print_json({"action": result.action, **_stream_facts(s), "changes": list(result.changes)})
    elif result.action == "created":
        print(f"created stream {s.name}: {_describe_stream(s)}")
    elif result.action == "updated":
        print(f"updated stream {s.name}: {'; '.join(result.changes)}")
    else:
        print(f"stream {s.name} unchanged: {_describe_stream(s)}")
    return EXIT_OK


# ---------------------------------------------------------------------------- publish


def _configure_publish(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="partitioned stream to publish to")
    p.add_argument(
        "file",
        metavar="FILE",
        help="input file (.jsonl/.ndjson/.json, .csv, .parquet; .gz allowed for JSON lines "
        "and CSV), or - for JSON lines on stdin",
    )
    p.add_argument(
        "--key-field",
        metavar="F",
        help="column holding each record's partition key (required unless --allow-keyless)",
    )
    p.add_argument(
        "--order-by",
        metavar="COLS",
        help="stable-sort the rows by these comma-separated columns before publishing "
        "(null/empty values last); loads the whole file in memory, whereas without it rows "
        "stream through with bounded memory",
    )
    p.add_argument(
        "--msg-id-field",
        metavar="F",
        help="column holding a unique record id used as Nats-Msg-Id for de-duplication "
        "(default: an id derived from producer id, position, key and payload)",
    )
    p.add_argument(
        "--format",
        choices=tuple(FORMATS),
        help="input format (default: from the file extension; stdin is jsonl)",
    )
    p.add_argument(
        "--producer-id",
        metavar="ID",
        help="stable id of this logical run, mixed into derived msg-ids: a rerun with the same "
        "id de-duplicates, a different id publishes again",
    )
    p.add_argument(
        "--allow-keyless",
        action="store_true",
        help="publish records without a key round-robin instead of refusing them",
    )
    p.add_argument("--max-in-flight", type=_positive_int, metavar="N", help="unacked per partition")
    p.add_argument("--batch-size", type=_positive_int, metavar="N", help="records per batch")
    p.add_argument(
        "--linger-ms", type=_non_negative_float, metavar="N", help="commit an idle batch after N ms"
    )
    p.add_argument(
        "--ack-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="resend when the server has not acknowledged within this long (default 5)",
    )
    p.add_argument(
        "--delivery-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="give up on a partition's records (reported as failed, exit 1) after retrying "
        "this long (default 120)",
    )
    p.add_argument(
        "--expect-partitions",
        type=_positive_int,
        metavar="N",
        help="fail unless the stream has N partitions",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr once a second (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary as a JSON object on stdout"
    )


@dataclass
class _Refusals:
    """Records that were not published, by reason, with the first few as examples."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, rec: InputRecord, message: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < REFUSED_EXAMPLES:
            self.examples.append(
                {"where": rec.where, "reason": reason, "key": rec.key, "message": message}
            )


class _Feeder:
    """Reads records in a daemon thread and hands them to the event loop in bursts.

    The loop never blocks on file or stdin reads (so signals and acknowledgements are
    handled while a pipe is quiet), at most ``max_buffered`` records wait in memory, and a
    reader error is re-raised in the loop after the records read before it.
    """

    def __init__(
        self,
        records: Iterable[InputRecord],
        loop: asyncio.AbstractEventLoop,
        max_buffered: int = 4096,
    ) -> None:
        self._records = records
        self._loop = loop
        self._max = max_buffered
        self._buf: deque[InputRecord] = deque()
        self._cond = threading.Condition()
        self._ready = asyncio.Event()
        self._done = False
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nats-ordered-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._ready.set)

    def _run(self) -> None:
        try:
            for rec in self._records:
                with self._cond:
                    while len(self._buf) >= self._max and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    was_empty = not self._buf
                    self._buf.append(rec)
                if was_empty:
                    self._wake()
        except BaseException as exc:  # handed to the loop, re-raised there
            self._error = exc
        finally:
            with self._cond:
                self._done = True
            self._wake()

    async def bursts(self) -> AsyncIterator[list[InputRecord]]:
        while True:
            await self._ready.wait()
            with self._cond:
                self._ready.clear()
                items = list(self._buf)
                self._buf.clear()
                done, error, stopped = self._done, self._error, self._stopped
                self._cond.notify_all()
            if stopped:
                return
            if items:
                yield items
            if done:
                if error is not None:
                    raise error
                return

    def stop(self) -> None:
        """Stop reading (call from the loop's thread); :meth:`bursts` ends at once."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._ready.set()


class _Progress:
    """Progress on stderr at most once a second: records read, acked, refused, rate."""

    def __init__(self, pub: OrderedPublisher, refusals: _Refusals, stream: IO[str]) -> None:
        self.pub = pub
        self.refusals = refusals
        self.stream = stream
        self.read = 0
        self.tty = stream.isatty()
        self._task: asyncio.Task[None] | None = None
        self._shown = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        last_t, last_acked = time.monotonic(), 0
        while True:
            await asyncio.sleep(1.0)
            now, acked = time.monotonic(), self.pub.acked
            rate = (acked - last_acked) / max(now - last_t, 1e-9)
            last_t, last_acked = now, acked
            text = (
                f"read {self.read}, acked {acked}, refused {self.refusals.total}"
                f"{f', failed {self.pub.failed}' if self.pub.failed else ''}, {rate:,.0f} msg/s"
            )
            if self.tty:
                self.stream.write(f"\r{text}\x1b[K")
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
            self._shown = True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._shown and self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class _Signals:
    """First SIGINT/SIGTERM: stop reading and flush what was accepted. Second: ``on_abort``.

    The abort does not wait for anything (a server that stopped answering would make a
    flush wait up to the delivery timeout), so it ends the process.
    """

    def __init__(self, on_stop: Callable[[], None], on_abort: Callable[[int], None]) -> None:
        self.stop = asyncio.Event()
        self._on_stop = on_stop
        self._on_abort = on_abort
        self.signum: int | None = None
        self._installed: list[int] = []

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        self._installed.clear()

    def _on_signal(self, sig: int) -> None:
        if not self.stop.is_set():
            self.signum = sig
            self.stop.set()
            self._on_stop()
            _err(
                "\ninterrupted: finishing the records already accepted "
                "(interrupt again to abort without waiting)"
            )
            return
        self._on_abort(self.exit_code)

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT


def _publisher_knobs(args: argparse.Namespace) -> dict[str, Any]:
    knobs = {
        "max_in_flight": args.max_in_flight,
        "batch_size": args.batch_size,
        "linger": None if args.linger_ms is None else args.linger_ms / 1000.0,
        "ack_timeout": args.ack_timeout,
        "delivery_timeout": args.delivery_timeout,
        "producer_id": args.producer_id,
        "allow_keyless": args.allow_keyless or None,
    }
    return {k: v for k, v in knobs.items() if v is not None}


async def _run_publish(args: argparse.Namespace, options: ConnectionOptions) -> int:
    if not args.key_field and not args.allow_keyless:
        raise ConfigError(
            "publish needs --key-field F (the column holding each record's partition key); "
            "pass --allow-keyless to publish records without keys round-robin instead"
        )
    # open (and check the fields of) the input before connecting: a typo fails at once
    with open_records(
        args.file,
        key_field=args.key_field,
        fmt=args.format,
        msg_id_field=args.msg_id_field,
        order_by=args.order_by,
    ) as reader:
        async with _connected(options) as nc:
            pub = OrderedPublisher(
                nc,
                args.stream,
                expected_partitions=args.expect_partitions,
                **_publisher_knobs(args),
            )
            return await _publish(args, pub, reader, reader.name, reader.format)


async def _publish(
    args: argparse.Namespace,
    pub: OrderedPublisher,
    records: Iterable[InputRecord],
    input_name: str,
    input_format: str,
) -> int:
    await pub.start()
    refusals = _Refusals()
    feeder = _Feeder(records, asyncio.get_running_loop())

    def abort(code: int) -> None:
        unsure = pub.accepted - pub.acked - pub.failed
        _err(
            f"aborted: {pub.acked} records acknowledged, {unsure} accepted records may not have "
            "been stored; publish the same input again (same --producer-id) to complete it: "
            "records already stored are de-duplicated"
        )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)  # do not wait for the flush (or anything else)

    signals = _Signals(on_stop=feeder.stop, on_abort=abort)
    show_progress = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = _Progress(pub, refusals, sys.stderr)
    input_error: InputError | None = None
    id_field = args.msg_id_field
    read = 0
    t0 = time.monotonic()
    signals.install()
    try:
        feeder.start()
        if show_progress:
            progress.start()
        try:
            async for burst in feeder.bursts():
                for rec in burst:
                    if signals.stop.is_set():
                        break
                    read += 1
                    progress.read = read
                    if id_field and rec.msg_id is None:
                        refusals.add("no msg-id", rec, f"field {id_field!r} is missing or empty")
                        continue
                    try:
                        await pub.publish(rec.key, rec.payload, msg_id=rec.msg_id)
                    except MissingKeyError as exc:
                        refusals.add("no key", rec, str(exc))
                    except InvalidKeyError as exc:
                        refusals.add("bad key", rec, str(exc))
                    except RecordTooLargeError as exc:
                        refusals.add("too large", rec, str(exc))
                    except InvalidMsgIdError as exc:
                        refusals.add("bad msg-id", rec, str(exc))
                    if not read % 512:
                        await asyncio.sleep(0)  # let the partition senders run
                if signals.stop.is_set():
                    break
                await asyncio.sleep(0)
        except InputError as exc:
            input_error = exc
        finally:
            feeder.stop()
        summary = await pub.close(raise_on_failure=False)
    finally:
        signals.uninstall()
        await progress.stop()
    assert summary is not None
    elapsed = time.monotonic() - t0
    report = _publish_report(summary, refusals, read, elapsed, input_name, input_format)
    report["interrupted"] = signals.stop.is_set()
    if input_error is not None:
        report["error"] = str(input_error)
    _print_publish(report, summary, refusals, as_json=args.json)
    if input_error is not None:
        raise input_error  # printed as "error: ...", exit 2
    if signals.stop.is_set():
        return signals.exit_code
    return EXIT_RECORDS if summary.failed or refusals.total else EXIT_OK


def _publish_report(
    summary: PublishSummary,
    refusals: _Refusals,
    read: int,
    elapsed: float,
    input_name: str,
    input_format: str,
) -> dict[str, Any]:
    stored = (
        None
        if any(p.stored is None for p in summary.partitions)
        else sum(p.stored or 0 for p in summary.partitions)
    )
    failure = next((p.error for p in summary.partitions if p.error), None)
    return {
        "stream": summary.stream,
        "input": input_name,
        "format": input_format,
        "read": read,
        "accepted": summary.accepted,
        "acked": summary.acked,
        "stored": stored,
        "duplicates": summary.duplicates,
        "failed": summary.failed,
        "refused": refusals.total,
        "refused_by_reason": dict(refusals.counts),
        "refused_examples": refusals.examples,
        "elapsed": round(elapsed, 3),
        "rate": round(summary.acked / elapsed, 1) if elapsed > 0 else None,
        "first_failure": failure,
        "high_water_marks": {str(p.partition): p.last_seq for p in summary.partitions},
        "partitions": [
            {
                "partition": p.partition,
                "accepted": p.accepted,
                "acked": p.acked,
                "stored": p.stored,
                "duplicates": p.duplicates,
                "failed": p.failed,
                "last_seq": p.last_seq,
                "retries": p.retries,
                "error": p.error,
            }
            for p in summary.partitions
        ],
    }


def _print_publish(
    report: dict[str, Any], summary: PublishSummary, refusals: _Refusals, *, as_json: bool
) -> None:
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(refusals.counts.items()))
    rate = report["rate"]
    line = (
        f"published {report['read']} records to {report['stream']} in {report['elapsed']:.1f}s "
        f"({rate:,.0f} msg/s): {report['acked']} acked, {report['refused']} refused"
        f"{f' ({reasons})' if reasons else ''}, {report['failed']} failed, "
        f"{report['duplicates']} duplicates"
    )
    if report["interrupted"]:
        line += " (interrupted: the rest of the input was not read)"
    if as_json:
        _print_json(report)
        _err(line)
    else:
        print(line, flush=True)
    for ex in refusals.examples:
        key = "" if ex["key"] is None else f" (key {ex['key']!r})"
        _err(f"refused {ex['where']}{key}: {ex['reason']}: {ex['message']}")
    if refusals.total > len(refusals.examples):
        _err(f"... and {refusals.total - len(refusals.examples)} more refused records")
    if summary.failed:
        first = report["first_failure"] or "unknown"
        _err(f"error: {PublishError(summary, first)}")


# ---------------------------------------------------------------------------- info


def _configure_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="partitioned stream")
    p.add_argument("--json", action="store_true", help="print a JSON object")


async def _run_info(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with _connected(options) as nc:
        stream = await describe(nc, args.stream)
        stats = await partition_stats(nc, stream)
    if args.json:
        _print_json(
            {
                "stream": stream.name,
                "partitions": stream.partitions,
                "prefix": stream.prefix,
                "hash": stream.hash_name,
                "seed": stream.seed,
                "duplicate_window": stream.duplicate_window,
                "storage": stream.storage,
                "replicas": stream.replicas,
                "messages": sum(s.messages for s in stats),
                "partition_stats": [
                    {
                        "partition": s.partition,
                        "subject": s.subject,
                        "messages": s.messages,
                        "last_seq": s.last_seq,
                    }
                    for s in stats
                ],
            }
        )
        return EXIT_OK
    print(
        format_table(
            ("partition", "subject", "messages", "last_seq"),
            [(s.partition, s.subject, s.messages, s.last_seq) for s in stats],
            footer=[
                (
                    "total",
                    "",
                    sum(s.messages for s in stats),
                    max((s.last_seq for s in stats), default=0),
                )
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
    return EXIT_OK


# ---------------------------------------------------------------------------- worker


def _configure_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="partitioned stream")
    p.add_argument(
        "--group",
        required=True,
        metavar="G",
        help="consumer group: members share its partitions; each group sees all",
    )
    p.add_argument(
        "--handler",
        required=True,
        metavar="MODULE:FUNC",
        help="the handler, e.g. mypkg.handlers:apply (a function, coroutine or "
        "class; see airflow_nats_ordered.handlers)",
    )
    p.add_argument(
        "--member-id", metavar="ID", default=None, help="stable member id (default: HOST-PID)"
    )
    p.add_argument(
        "--lease-ttl",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="partition lease TTL; a dead member's partitions move after it "
        "(default 5; every member of a group must use the same)",
    )
    p.add_argument(
        "--fetch-batch",
        type=_positive_int,
        default=500,
        metavar="N",
        help="messages read per request (default 500)",
    )
    p.add_argument(
        "--commit-every",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="commit the position every N messages (default 1000)",
    )
    p.add_argument(
        "--commit-interval",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="... or every this many seconds (default 1)",
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
        type=_positive_float,
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
        "--audit-log",
        metavar="FILE",
        default=None,
        help="append lease windows and assignments as JSON lines (for audits)",
    )


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
    if args.member_id:
        kw["member_id"] = args.member_id
    return WorkerConfig(args.stream, args.group, **kw)


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


async def _run_worker(args: argparse.Namespace, options: ConnectionOptions) -> int:
    cfg = _worker_config(args)
    loaded = load_handler(args.handler)
    # a long-running member rides out server restarts: reconnect for as long as it takes
    options = dataclasses.replace(options, max_reconnect_attempts=-1)
    async with _connected(options) as nc:
        worker = Worker(
            nc, cfg, loaded.handler, on_assign=loaded.on_assign, on_revoke=loaded.on_revoke
        )
        stop = asyncio.Event()
        received: list[int] = []

        def exit_now(sig: int, _frame: object = None) -> None:
            os._exit(EXIT_SIGTERM if sig == signal.SIGTERM else EXIT_SIGINT)

        def on_signal(sig: int) -> None:
            received.append(sig)
            if len(received) == 1:
                _err(
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
        _err(f"member {cfg.member_id} joined group {cfg.group} of {cfg.stream}")
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait(
            {waiter, asyncio.ensure_future(worker.stopped.wait())},
            return_when=asyncio.FIRST_COMPLETED,
        )
        crashed = not stop.is_set()
        await worker.stop()
        if loaded.close is not None:
            r = loaded.close()
            if inspect.isawaitable(r):
                await r
        st = worker.stats
        _err(
            f"member {cfg.member_id} left: {st['processed']:,} messages processed, "
            f"{st['retries']} retries, {st['dead_lettered']} dead-lettered, "
            f"{st['fenced']} fenced, {st['leases_lost']} leases lost"
        )
    return EXIT_USAGE if crashed else EXIT_OK


# ---------------------------------------------------------------------------- status


def _configure_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", required=True, metavar="S", help="partitioned stream")
    p.add_argument("--group", required=True, metavar="G", help="consumer group")
    p.add_argument("--json", action="store_true", help="print a JSON object")


async def _run_status(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with _connected(options) as nc:
        stream = await describe(nc, args.stream)
        stats = await partition_stats(nc, stream)
        store = await GroupStore.attach(nc, args.stream, args.group)
        snap = await store.snapshot()
    generation = None
    if snap.assignment:
        generation = Assignment.from_json(snap.assignment).generation
    now = time.time()
    parts = []
    for s in stats:
        c = snap.commits.get(s.partition)
        committed = c.seq if c else 0
        owner = snap.leases.get(s.partition, (None, 0))[0]
        parts.append(
            {
                "partition": s.partition,
                "owner": owner,
                "fencing_token": c.token if c else 0,
                "committed": committed,
                "last": s.last_seq,
                "lag": _lag(s.last_seq, committed, s.messages),
                "blocked": snap.blocked.get(s.partition),
            }
        )
    members = [
        {
            "member": m,
            "host": info.get("host"),
            "pid": info.get("pid"),
            "partitions": sorted(p["partition"] for p in parts if p["owner"] == m),
            "heartbeat_age": round(max(0.0, now - float(info.get("ts", now))), 3),
        }
        for m, info in sorted(snap.members.items())
    ]
    out = {
        "stream": stream.name,
        "group": args.group,
        "generation": generation,
        "leader": snap.leader,
        "partitions": parts,
        "members": members,
    }
    if args.json:
        _print_json(out)
        return EXIT_OK
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
            footer=[("total", "", "", "", "", sum(p["lag"] for p in parts), "")],
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
    print(
        f"group {args.group} of {stream.name}: generation {generation or '-'}, "
        f"leader {snap.leader or '-'}, {len(members)} member(s), "
        f"lag {sum(p['lag'] for p in parts):,}"
    )
    return EXIT_OK


def _lag(last: int, committed: int, messages: int) -> int:
    """Messages after the committed position (an upper bound: sequences are shared by all
    partitions, so the count comes from the partition's own messages)."""
    if committed >= last:
        return 0
    return messages if committed == 0 else min(messages, last - committed)


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """One subcommand: its flags (``configure``) and its body (``run``, returns the exit code)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, ConnectionOptions], Awaitable[int]]
    description: str = ""


COMMANDS: list[Command] = [
    Command(
        "provision",
        "create a partitioned stream, or verify it and apply safe changes",
        _configure_provision,
        _run_provision,
        "Idempotent: running it again changes nothing. Flags left out keep the existing "
        "stream's values (defaults when creating). The partition count, subject prefix and "
        "storage cannot change in place; asking for other values is an error (exit 2).",
    ),
    Command(
        "publish",
        "publish a JSON lines, CSV or Parquet file, in order per key, exactly once",
        _configure_publish,
        _run_publish,
        "Each row is published as compact JSON to the partition of its key. Publishing the "
        "same file again (same order, same --producer-id, within the stream's duplicate "
        "window) stores nothing twice. Exit 0 when every record was stored, 1 when records "
        "were refused (no key, too large) or failed, 2 for usage/input/connection errors.",
    ),
    Command(
        "worker",
        "run a member of a consumer group: owns partitions by lease, processes them in order",
        _configure_worker,
        _run_worker,
        "Members of a group share the stream's partitions and rebalance when members join, "
        "leave or die. SIGTERM/SIGINT: finish the message in hand, commit, release, exit 0 "
        "(a second signal exits at once). SIGUSR1 dumps every thread's stack to stderr, "
        "SIGUSR2 every asyncio task's.",
    ),
    Command(
        "status",
        "show a group: owner, fencing token, committed position and lag per partition",
        _configure_status,
        _run_status,
    ),
    Command(
        "info",
        "show a partitioned stream: per-partition message counts and last sequences",
        _configure_info,
        _run_info,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nats-ordered",
        description="Kafka-like per-key ordered event pipelines on NATS JetStream.",
        epilog="Run `nats-ordered COMMAND --help` for the flags of a command.",
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
        )
        cmd.configure(p)
        _add_connection_flags(p)
        p.set_defaults(_command=cmd)
    return parser


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
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
    try:
        options = connection_options(args)
        return asyncio.run(cmd.run(args, options))
    except NatsOrderedError as exc:
        _err(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_SIGINT
    except (nats.errors.Error, TimeoutError) as exc:
        _err(f"error: {_nats_error_text(exc)}")
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `nats-ordered info ... | head`
        with contextlib.suppress(Exception):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the exit flush
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
