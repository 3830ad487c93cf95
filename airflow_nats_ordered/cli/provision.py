"""``nats-ordered provision``: create a partitioned stream, or verify it and apply safe changes."""

from __future__ import annotations

import argparse
from typing import Any

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    Command,
    connected,
    format_duration,
    parse_duration,
    parse_size,
    positive_int,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import StreamNotFoundError
from airflow_nats_ordered.core.stream.partitioned import (
    DEFAULT_DUPLICATE_WINDOW,
    STREAM_NAME_RULE,
    PartitionedStream,
    ProvisionResult,
    StreamSpec,
    describe,
    provision,
    purge_strays,
)
from airflow_nats_ordered.core.stream.strays import Strays


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream",
        required=True,
        type=stream_name,
        metavar="S",
        help=f"stream name: {STREAM_NAME_RULE}",
    )
    p.add_argument(
        "--partitions",
        required=True,
        type=positive_int,
        metavar="N",
        help="number of partitions; provision refuses a different count for an existing "
        "stream: change it with `nats-ordered repartition`",
    )
    p.add_argument(
        "--subject-prefix",
        metavar="P",
        help="subjects are P.p.<n> (default: the stream name in lower case)",
    )
    p.add_argument("--replicas", type=positive_int, metavar="R", help="replicas (default 1)")
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
    p.add_argument(
        "--purge-strays",
        action="store_true",
        help="remove the stray messages the stream holds (stored on subjects that are not "
        "partition subjects, before it was narrowed; no worker reads them). Deletes them: "
        "republish what you need first",
    )
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
        max_age=_limit(args.max_age, cfg.max_age if cfg else None),
        max_bytes=_limit(args.max_bytes, cfg.max_bytes if cfg else None),  # type: ignore[arg-type]
        max_msgs=_limit(args.max_msgs, cfg.max_msgs if cfg else None),  # type: ignore[arg-type]
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
        f"{stream.partitions} partitions on {stream.subjects_text}",
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


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        try:
            current: PartitionedStream | None = await describe(nc, args.stream)
        except StreamNotFoundError:
            current = None
        spec = _spec_from_args(args, current)
        result: ProvisionResult = await provision(nc, spec)
        strays = result.strays or Strays(spec.name, spec.partitions)
        purged = await purge_strays(nc, result.stream) if args.purge_strays and strays else None
    s = result.stream
    if args.json:
        print_json(
            {
                "action": result.action,
                **_stream_facts(s),
                "changes": list(result.changes),
                "narrowed": result.narrowed,
                "strays": {
                    "messages": 0 if purged else strays.messages,
                    "subjects": {} if purged else dict(strays.subjects),
                    "purged": purged.messages if purged else 0,
                },
            }
        )
        return EXIT_OK
    if result.action == "created":
        print(f"created stream {s.name}: {_describe_stream(s)}")
    elif result.action == "updated":
        print(f"updated stream {s.name}: {'; '.join(result.changes)}")
    else:
        print(f"stream {s.name} unchanged: {_describe_stream(s)}")
    if purged:
        print(
            f"purged {purged.messages} stray message(s) from {len(purged.subjects)} subject(s): "
            + ", ".join(purged.subjects)
        )
    elif strays:
        print(f"problem: {strays.problem()}")
    return EXIT_OK


COMMAND = Command(
    "provision",
    "create a partitioned stream, or verify it and apply safe changes",
    configure,
    run,
    "Idempotent: running it again changes nothing. Flags left out keep the existing "
    "stream's values (defaults when creating). The stream's subjects are exactly its "
    "partition subjects <prefix>.p.0 ... <prefix>.p.<N-1>, so the server refuses a publish "
    "to any other subject; a stream created with the old wildcard <prefix>.p.* is narrowed "
    "in place (messages it stored on other subjects stay, as strays, until --purge-strays). "
    "The partition count, subject prefix and storage cannot change in place; asking for "
    "other values is an error (exit 2).",
)
