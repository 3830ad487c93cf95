"""``nats-ordered dead-letters``: list, show, replay and purge a group's dead letters (the
records its workers set aside with ``--poison dead-letter``, in ``<STREAM>_DLQ``)."""

from __future__ import annotations

import argparse
from typing import Any

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    Command,
    add_connection_flags,
    connected,
    format_table,
    group_name,
    partition_list,
    positive_int,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.dead_letters import (
    DeadLetter,
    dead_letter_place,
    purge_dead_letters,
    read_dead_letters,
    replay_dead_letters,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError

#: how much of a reason the table shows
_REASON_WIDTH = 60


def _sequences(text: str) -> list[int]:
    """Dead-letter sequences from ``"12"``, ``"12,15"`` or ``"12-20"``."""
    try:
        return partition_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid sequences {text!r}: give dead-letter sequences, e.g. 12 or 12,15 or 12-20"
        ) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument("--group", required=True, type=group_name, metavar="G", help="consumer group")


def _partitions(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--partitions",
        type=partition_list,
        metavar="LIST",
        help=f"only {what} of these partitions (where they were read), e.g. 0,3-5",
    )


def configure(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def sub(name: str, help: str, description: str) -> argparse.ArgumentParser:
        a = actions.add_parser(
            name,
            help=help,
            description=description,
            epilog=p.epilog,
            formatter_class=p.formatter_class,
        )
        _common(a)
        return a

    ls = sub(
        "list",
        "list a group's dead letters: sequence, partition, key, reason, time",
        "One row per dead letter of the group, in the order they were stored: its sequence "
        "in <STREAM>_DLQ (what show, replay and purge take), the partition and stream "
        "sequence it was read from, its key, why it was set aside and when.",
    )
    _partitions(ls, "dead letters")
    ls.add_argument("--limit", type=positive_int, metavar="N", help="show at most N")
    ls.add_argument("--json", action="store_true", help="print a JSON object")

    show = sub(
        "show",
        "show one dead letter: every header and the payload",
        "Every header of the dead letter (the original record's, plus Nats-Ordered-Error and "
        "Nats-Ordered-Origin) and its payload (as text if it is UTF-8, else base64).",
    )
    show.add_argument("seq", type=int, metavar="SEQ", help="its sequence (from `list`)")
    show.add_argument("--json", action="store_true", help="print a JSON object")

    replay = sub(
        "replay",
        "publish dead letters again, into their partition (or to --subject)",
        "Publish the group's dead letters (all, or --seq / --partitions) again, one at a time "
        "in the order they were first stored, each acknowledged before the next. Each goes "
        "to the partition its key hashes to (a record dead-lettered as misrouted goes to the "
        "right one; a keyless one to the partition it came from) with its payload and key "
        "header, so the group's workers process it again, after what the partition holds "
        "now. It carries a new Nats-Msg-Id derived from the original record, so replaying "
        "twice inside the stream's duplicate window stores it once ('duplicate'), and "
        "Nats-Ordered-Replay-Of (its origin) instead of the error and origin headers. A "
        "record whose key cannot be decoded cannot be routed: give --subject. Dead letters "
        "are kept unless --purge.",
    )
    replay.add_argument(
        "--seq", type=_sequences, metavar="SEQS", help="only these, e.g. 12 or 12,15 or 12-20"
    )
    _partitions(replay, "the dead letters")
    replay.add_argument(
        "--subject",
        metavar="SUBJECT",
        help="publish to this subject instead (e.g. a holding stream's); a partition subject "
        "must be the record's own",
    )
    replay.add_argument(
        "--purge",
        action="store_true",
        help="remove each dead letter once its replay is acknowledged",
    )
    replay.add_argument("--dry-run", action="store_true", help="only show where each would go")
    replay.add_argument("--json", action="store_true", help="print a JSON object")

    purge = sub(
        "purge",
        "remove dead letters (--seq, --partitions or --all)",
        "Remove the group's dead letters: those at --seq, those of --partitions, or --all "
        "(one of them is required). Other groups' dead letters are never touched; the "
        "dead-letter stream stays (`group delete --dead-letters` removes it with the group).",
    )
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--seq", type=_sequences, metavar="SEQS", help="these, e.g. 12 or 12,15 or 12-20"
    )
    which.add_argument(
        "--partitions",
        type=partition_list,
        metavar="LIST",
        help="every dead letter of these partitions, e.g. 0,3-5",
    )
    which.add_argument("--all", action="store_true", help="every dead letter of the group")
    purge.add_argument("--dry-run", action="store_true", help="only say what would go")
    purge.add_argument("--json", action="store_true", help="print a JSON object")

    for a in (ls, show, replay, purge):
        add_connection_flags(a)


def _short(text: str | None, width: int) -> str | None:
    if text is None:
        return None
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def _key_cell(letter: DeadLetter) -> str | None:
    if letter.key_problem:
        return "(malformed)"
    return _short(repr(letter.key) if letter.key is not None else None, 40)


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    async with connected(options) as nc:
        place = await dead_letter_place(nc, args.stream, args.group)
        if args.action == "list":
            letters = await read_dead_letters(
                nc, place, partitions=args.partitions, limit=args.limit
            )
            return _list(args, place.stream, letters)
        if args.action == "show":
            (letter,) = await read_dead_letters(nc, place, seqs=[args.seq])
            return _show(args, letter)
        if args.action == "replay":
            letters = await read_dead_letters(nc, place, partitions=args.partitions, seqs=args.seq)
            if not letters:
                print(
                    f"nothing to replay: group {args.group} has no dead letters"
                    + (" of those partitions" if args.partitions else "")
                )
                return EXIT_OK
            try:
                result = await replay_dead_letters(
                    nc,
                    place,
                    args.stream,
                    letters,
                    subject=args.subject,
                    purge=args.purge,
                    dry_run=args.dry_run,
                )
            except ConfigError as exc:
                raise ConfigError(f"{exc}. Select others with --seq, or give --subject") from None
            return _replayed(args, result.replays)
        done = await purge_dead_letters(
            nc, place, seqs=args.seq, partitions=args.partitions, dry_run=args.dry_run
        )
    if args.json:
        print_json(
            {
                "stream": done.stream,
                "group": done.group,
                "dry_run": done.dry_run,
                "purged": [] if done.dry_run else done.seqs,
                "would_purge": done.seqs if done.dry_run else [],
            }
        )
    elif done.dry_run:
        print(f"dry run: would purge {len(done.seqs):,} dead letter(s) of group {done.group}")
    else:
        print(f"purged {len(done.seqs):,} dead letter(s) of group {done.group} from {done.stream}")
    return EXIT_OK


def _list(args: argparse.Namespace, stream: str, letters: list[DeadLetter]) -> int:
    if args.json:
        print_json(
            {
                "stream": stream,
                "group": args.group,
                "dead_letters": [x.to_dict() for x in letters],
            }
        )
        return EXIT_OK
    if not letters:
        print(f"no dead letters of group {args.group} in {stream}")
        return EXIT_OK
    print(
        format_table(
            ("seq", "partition", "origin seq", "key", "reason", "time"),
            [
                (
                    x.seq,
                    x.partition,
                    x.origin_seq,
                    _key_cell(x),
                    _short(x.reason, _REASON_WIDTH),
                    x.time.strftime("%Y-%m-%d %H:%M:%S") if x.time else None,
                )
                for x in letters
            ],
        )
    )
    print(f"{len(letters):,} dead letter(s) of group {args.group} in {stream}")
    return EXIT_OK


def _show(args: argparse.Namespace, letter: DeadLetter) -> int:
    d = letter.to_dict(payload=True)
    if args.json:
        print_json(d)
        return EXIT_OK
    print(f"dead letter {letter.seq} of group {args.group} ({letter.subject}, {d['time']})")
    print(f"reason: {letter.reason}")
    print("headers:")
    for k, v in sorted(letter.headers.items()):
        print(f"  {k}: {v}")
    print(f"payload ({d['size']:,} bytes, {d['data_encoding']}):")
    print(d["data"])
    return EXIT_OK


def _replayed(args: argparse.Namespace, replays: list[Any]) -> int:
    if args.json:
        print_json(
            {
                "stream": args.stream,
                "group": args.group,
                "dry_run": bool(args.dry_run),
                "replays": [r.to_dict() for r in replays],
            }
        )
        return EXIT_OK
    print(
        format_table(
            ("seq", "from partition", "key", "to", "outcome"),
            [
                (
                    r.letter.seq,
                    r.letter.partition,
                    _key_cell(r.letter),
                    r.subject,
                    r.error if r.error else r.outcome,
                )
                for r in replays
            ],
        )
    )
    if args.dry_run:
        print("dry run: nothing published")
    else:
        stored = sum(1 for r in replays if r.outcome == "stored")
        dup = len(replays) - stored
        line = f"replayed {len(replays):,} dead letter(s): {stored:,} stored"
        if dup:
            line += f", {dup:,} already replayed (duplicate inside the window)"
        if args.purge:
            line += f"; {sum(1 for r in replays if r.purged):,} purged"
        print(line)
    return EXIT_OK


COMMAND = Command(
    "dead-letters",
    "list, show, replay or purge a group's dead letters",
    configure,
    run,
    "The records a group's workers set aside with --poison dead-letter, stored in the "
    "stream <STREAM>_DLQ on <prefix>.dlq.<group>.<partition>.",
    connection_flags=False,
)
