"""``nats-ordered publish``: publish a JSON lines, CSV or Parquet file, in order per key."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import IO, Any

from airflow_nats_ordered.cli.common import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Command,
    connected,
    non_negative_float,
    positive_float,
    positive_int,
    positive_size,
    print_err,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.config import check_producer_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.runs import Refusals, publish_record
from airflow_nats_ordered.core.publish.summary import PublishError, PublishSummary
from airflow_nats_ordered.inputs.files import FORMATS, content_digest, open_records
from airflow_nats_ordered.inputs.records import InputError, InputRecord
from airflow_nats_ordered.members.metrics import MetricsServer, serve_publisher

#: The flag that publishes keyless records (named in refusals, in this interface's terms).
_KEYLESS = "--allow-keyless"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream",
        required=True,
        type=stream_name,
        metavar="S",
        help="partitioned stream to publish to",
    )
    p.add_argument(
        "file",
        metavar="FILE",
        help="input file (.jsonl/.ndjson/.json, .csv, .parquet; .gz allowed for JSON lines "
        "and CSV), or - for JSON lines on stdin",
    )
    p.add_argument(
        "--key-field",
        metavar="F",
        help=(
            "column holding each record's partition key (required unless --allow-keyless): "
            "a string is used exactly as written, an integer as its decimal digits, UTF-8 "
            "binary as its text; other values (floats, booleans, dates, ...) are refused: "
            "write the key as a string. At most 4096 bytes in UTF-8"
        ),
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
        "(default: an id derived from producer id, the record's place in the input, key and "
        "payload)",
    )
    p.add_argument(
        "--format",
        choices=tuple(FORMATS),
        help="input format (default: from the file extension; stdin is jsonl)",
    )
    p.add_argument(
        "--producer-id",
        type=producer_id_arg,
        metavar="ID",
        help="id of this logical run, mixed into derived msg-ids: a rerun with the same id "
        "stores nothing twice, a different id publishes again (default for a file: "
        "file-<digest of its content>, so rerunning the same file de-duplicates; for stdin: "
        "a new id per run). Must not be empty or blank. The summary shows the id used; after "
        "an input error, re-publish the fixed file with the id the error names",
    )
    p.add_argument(
        "--allow-keyless",
        action="store_true",
        help="publish records without a key round-robin instead of refusing them",
    )
    p.add_argument(
        "--global-order",
        action="store_true",
        help="stamp every record with a global sequence (Nats-Global-Seq, publish order over "
        "all partitions) and write per-partition watermarks, so `nats-ordered global-read` "
        "can merge the partitions into one exact order. One global-order publisher per "
        "stream at a time: a second is refused while the first runs",
    )
    p.add_argument(
        "--max-pending-bytes",
        type=positive_size,
        metavar="SIZE",
        help="payload bytes held (queued plus unacknowledged) before reading waits, e.g. "
        "64MiB (default: the publisher's)",
    )
    p.add_argument("--max-in-flight", type=positive_int, metavar="N", help="unacked per partition")
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="records per batch")
    p.add_argument(
        "--linger-ms", type=non_negative_float, metavar="N", help="commit an idle batch after N ms"
    )
    p.add_argument(
        "--ack-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="resend when the server has not acknowledged within this long (default 5)",
    )
    p.add_argument(
        "--delivery-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="give up on a partition's records (reported as failed, exit 1) after retrying "
        "this long (default 120)",
    )
    p.add_argument(
        "--expect-partitions",
        type=positive_int,
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
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="while publishing, serve Prometheus counters (records acknowledged, failed, "
        "refused by reason) on http://ADDR:PORT/metrics: for a long-running publisher such "
        "as one reading stdin (default: not served)",
    )
    p.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default 127.0.0.1, this host only)",
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

    def __init__(self, pub: OrderedPublisher, refusals: Refusals, stream: IO[str]) -> None:
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
            print_err(
                "\ninterrupted: finishing the records already accepted "
                "(interrupt again to abort without waiting)"
            )
            return
        self._on_abort(self.exit_code)

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT


def producer_id_arg(text: str) -> str:
    """``--producer-id``'s value: refused (exit 2) when empty or blank, which is what an
    unset shell variable gives; taken as "not given" it would publish everything again."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty: a producer id must name the run (an unset shell variable, "
            'as in --producer-id "$RUN_ID" with RUN_ID unset, gives an empty value). Pass a '
            "stable id such as orders-2026-11-23, or leave --producer-id out: a file is then "
            "published as file-<digest of its content>"
        )
    try:
        return check_producer_id(text, "--producer-id")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _producer_id(args: argparse.Namespace) -> str | None:
    """``--producer-id``, else for a file ``file-<digest of its content>`` (a rerun of the
    same content de-duplicates wherever the file lives), else None: the publisher makes a
    unique one (stdin cannot be digested before it is published)."""
    if args.producer_id is not None:
        return str(args.producer_id)
    if args.file == "-":
        return None
    return f"file-{content_digest(args.file)}"


def _republish_hint(args: argparse.Namespace, pub: OrderedPublisher, read: int) -> str:
    """What makes "re-publishing the fixed file stores them only once" true: the same
    producer id. A derived msg-id is a digest of the producer id, the record's place in the
    input, its key and its payload, so the records before the bad one get the same ids
    again from the fixed file, but only under the same producer id; the default id of a
    file follows its content, which the fix changes."""
    if read == 0:  # e.g. --order-by reads the whole input before publishing any of it
        return " Nothing was published: publish the fixed input as before."
    published = f" The {read} record(s) before it were published"
    if args.file == "-":
        return f"{published}."  # stdin's producer id is printed in its own note
    if args.msg_id_field:  # msg-ids come from the file: any producer id de-duplicates them
        return f"{published}; re-publishing the fixed file stores them only once."
    same = "the same " if args.producer_id is not None else ""
    return (
        f"{published}; to store them only once, re-publish the fixed file with {same}--producer-id "
        f"{pub.producer_id} (within the stream's duplicate window)"
        + (
            "; without it the fixed file gets a new default id (its content changed) and "
            "those records are stored again"
            if args.producer_id is None
            else ""
        )
        + "."
    )


def _publisher_knobs(args: argparse.Namespace) -> dict[str, Any]:
    knobs = {
        "max_in_flight": args.max_in_flight,
        "batch_size": args.batch_size,
        "linger": None if args.linger_ms is None else args.linger_ms / 1000.0,
        "ack_timeout": args.ack_timeout,
        "delivery_timeout": args.delivery_timeout,
        "producer_id": _producer_id(args),
        "allow_keyless": args.allow_keyless or None,
        "max_pending_bytes": args.max_pending_bytes,
        "global_order": GlobalOrder() if args.global_order else None,
    }
    return {k: v for k, v in knobs.items() if v is not None}


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    if not args.key_field and not args.allow_keyless:
        raise ConfigError(
            "publish needs --key-field F (the column holding each record's partition key); "
            "pass --allow-keyless to publish records without keys round-robin instead"
        )
    # open (and check the fields of) the input before connecting: a typo fails at once
    opened = False
    try:
        with open_records(
            args.file,
            key_field=args.key_field,
            fmt=args.format,
            msg_id_field=args.msg_id_field,
            order_by=args.order_by,
        ) as reader:
            opened = True
            async with connected(options) as nc:
                pub = OrderedPublisher(
                    nc,
                    args.stream,
                    expected_partitions=args.expect_partitions,
                    **_publisher_knobs(args),
                )
                return await _publish(args, pub, reader, reader.name, reader.format)
    except InputError as exc:
        if opened:  # found while publishing: _publish said what went out before it
            raise
        # found while opening (--order-by reads the whole input first): nothing went out
        raise InputError(f"{exc} Nothing was published.") from None


async def _publish(
    args: argparse.Namespace,
    pub: OrderedPublisher,
    records: Iterable[InputRecord],
    input_name: str,
    input_format: str,
) -> int:
    refusals = Refusals()
    metrics = _serve_metrics(args, pub, refusals)  # first: a port in use is a usage error
    try:
        await pub.start()
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    feeder = _Feeder(records, asyncio.get_running_loop())

    def abort(code: int) -> None:
        unsure = pub.accepted - pub.acked - pub.failed
        print_err(
            f"aborted: {pub.acked} records acknowledged, {unsure} accepted records may not have "
            "been stored; publish the same input again with --producer-id "
            f"{pub.producer_id} to complete it: records already stored are de-duplicated"
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
                    await publish_record(
                        pub, rec, refusals, msg_id_field=id_field, keyless_switch=_KEYLESS
                    )
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
        if metrics is not None:
            metrics.close()
    assert summary is not None
    elapsed = time.monotonic() - t0
    report = _publish_report(summary, refusals, read, elapsed, input_name, input_format)
    report["producer_id"] = pub.producer_id
    report["interrupted"] = signals.stop.is_set()
    if input_error is not None:
        input_error = InputError(f"{input_error}{_republish_hint(args, pub, read)}")
        report["error"] = str(input_error)
        # the id alone, for a script to pass back as --producer-id (the error's text says
        # it in words)
        report["republish_with"] = pub.producer_id
    # a refused permission is said once, below, with the flag and the role
    _print_publish(report, summary, refusals, as_json=args.json, failure=pub.denied is None)
    if args.producer_id is None and args.file == "-":
        print_err(
            f"note: stdin was published as producer id {pub.producer_id}; to publish the same "
            f"records again without duplicates, pass --producer-id {pub.producer_id}"
        )
    if input_error is not None:
        raise input_error from None  # printed as "error: ...", exit 2
    if pub.denied is not None:
        raise pub.denied  # a refused permission: printed with the flag and role, exit 2
    if signals.stop.is_set():
        return signals.exit_code
    return EXIT_INCOMPLETE if summary.failed or refusals.total else EXIT_OK


def _serve_metrics(
    args: argparse.Namespace, pub: OrderedPublisher, refusals: Refusals
) -> MetricsServer | None:
    """``--metrics-port``: the publisher's counters while it runs; a port in use is a usage
    error (nothing was published yet)."""
    if getattr(args, "metrics_port", None) is None:
        return None
    try:
        return serve_publisher(
            args.stream,
            lambda: (pub.acked, pub.failed, dict(refusals.counts)),
            args.metrics_port,
            args.metrics_addr,
        )
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_addr}:"
            f"{args.metrics_port} ({exc.strerror}); pick a free port"
        ) from None


def _publish_report(
    summary: PublishSummary,
    refusals: Refusals,
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
    report: dict[str, Any],
    summary: PublishSummary,
    refusals: Refusals,
    *,
    as_json: bool,
    failure: bool = True,
) -> None:
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(refusals.counts.items()))
    rate = report["rate"]
    line = (
        f"published {report['read']} records to {report['stream']} in {report['elapsed']:.1f}s "
        f"({rate:,.0f} msg/s): {report['acked']} acked, {report['refused']} refused"
        f"{f' ({reasons})' if reasons else ''}, {report['failed']} failed, "
        f"{report['duplicates']} duplicates"
    )
    line += f"; producer id {report['producer_id']}"
    if report["interrupted"]:
        line += " (interrupted: the rest of the input was not read)"
    if as_json:
        print_json(report)
        print_err(line)
    else:
        print(line, flush=True)
    for ex in refusals.examples:
        key = "" if ex["key"] is None else f" (key {ex['key']!r})"
        print_err(f"refused {ex['where']}{key}: {ex['reason']}: {ex['message']}")
    if refusals.total > len(refusals.examples):
        print_err(f"... and {refusals.total - len(refusals.examples)} more refused records")
    if summary.failed and failure:
        first = report["first_failure"] or "unknown"
        print_err(f"error: {PublishError(summary, first)}")


COMMAND = Command(
    "publish",
    "publish a JSON lines, CSV or Parquet file, in order per key, exactly once",
    configure,
    run,
    "Each row is published as compact JSON to the partition of its key. Publishing the "
    "same file again (same order, same --producer-id, within the stream's duplicate "
    "window) stores nothing twice. Exit 0 when every record was stored, 1 when records "
    "were refused (no key, too large) or failed, 2 for usage/input/connection errors.",
)
