"""``nats-ordered permissions``: the exact NATS permissions of one role, ready to paste into a
nats-server config (:func:`~airflow_nats_ordered.core.admin.permissions.permissions_for`).

It does not connect to NATS: the set is derived from the stream's and group's names alone,
the way the code names its buckets and subjects. ``--format conf`` (default) prints a
``permissions { ... }`` block, every subject with the reason it is needed as a comment, or
with ``--user NAME`` a whole user entry for an ``authorization { users = [...] }`` or
``accounts { A { users = [...] } }`` list (its password read from the server's environment,
``$NAME_PASSWORD``); ``--format json`` prints the same set for tooling.

Exit codes: 0 printed; 2 a usage error (the message names the flag).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from airflow_nats_ordered.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    Command,
    group_name,
    print_err,
    print_json,
    stream_name,
)
from airflow_nats_ordered.core.admin.permissions import (
    GROUP_ROLES,
    ROLES,
    check_prefix,
    check_subject_prefix,
    check_user,
    js_api_prefix,
    permissions_for,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import ConfigError

ROLE_HELP = {
    "publisher": "publishes into the stream and keeps its run ledger (and global order's "
    "watermarks)",
    "worker": "a member of --group: leases, commits, heartbeats, its reads of the stream, "
    "the dead letters it writes",
    "reader": "a global-order reader in --group: its position, the producers' watermarks",
    "operator": "provision, repartition, reset, rebalance, dead letters, group delete "
    "(without --group: every group, i.e. the account's whole JetStream API)",
    "watcher": "the Airflow triggerer: the drain sensor's reads of --group, the nats:// "
    "watcher's durable consumer",
}


def _flag(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse ``type=`` from a check raising ConfigError (argparse names the flag)."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--role",
        required=True,
        choices=ROLES,
        help="; ".join(f"{r}: {h}" for r, h in ROLE_HELP.items()),
    )
    p.add_argument(
        "--stream", required=True, type=stream_name, metavar="S", help="partitioned stream"
    )
    p.add_argument(
        "--group",
        type=group_name,
        metavar="G",
        help="consumer group (needed by worker and reader; a watcher's drain sensor and an "
        "operator's narrowest set need it too; not with publisher)",
    )
    p.add_argument(
        "--subject-prefix",
        type=_flag(lambda t: check_subject_prefix(t, "--subject-prefix")),
        metavar="P",
        help="the stream's subject prefix, if it was provisioned with one (default: the "
        "stream name in lower case)",
    )
    p.add_argument(
        "--format",
        choices=("conf", "json"),
        default="conf",
        help="conf: a nats-server permissions block with a comment per subject (default); "
        "json: the same as a JSON object",
    )
    p.add_argument(
        "--user",
        dest="perm_user",
        type=_flag(lambda t: check_user(t, "--user")),
        metavar="NAME",
        help="print a whole user entry named NAME (password: $NAME_PASSWORD, from the "
        "server's environment) instead of the bare permissions block",
    )
    p.add_argument(
        "--inbox-prefix",
        dest="perm_inbox_prefix",
        default="_INBOX",
        type=_flag(lambda t: check_prefix(t, "--inbox-prefix")),
        metavar="P",
        help="the inbox prefix the role's clients use (default _INBOX): give each role its "
        "own so that no user can read another's replies",
    )
    api = p.add_mutually_exclusive_group()
    api.add_argument(
        "--js-domain",
        dest="perm_js_domain",
        type=_flag(lambda t: js_api_prefix(t, "--js-domain")),
        metavar="D",
        help="JetStream domain the clients use (API prefix $JS.<D>.API)",
    )
    api.add_argument(
        "--js-api-prefix",
        dest="perm_js_api_prefix",
        type=_flag(lambda t: check_prefix(t, "--js-api-prefix")),
        metavar="P",
        help="JetStream API prefix the clients use (default $JS.API)",
    )
    p.set_defaults(verbose=0)


async def run(args: argparse.Namespace, options: ConnectionOptions) -> int:
    del options  # never connects
    if args.role in GROUP_ROLES and args.group is None:
        print_err(
            f"error: --role {args.role} needs --group G (the consumer group it "
            f"{'works for' if args.role == 'worker' else 'reads in'})"
        )
        return EXIT_USAGE
    if args.role == "publisher" and args.group is not None:
        print_err(
            "error: --role publisher takes no --group: a publisher writes the stream and its "
            "run ledger for every group (drop --group, or pick the role that acts in it)"
        )
        return EXIT_USAGE
    if args.perm_js_api_prefix is not None:
        api_prefix = args.perm_js_api_prefix
    else:
        api_prefix = js_api_prefix(args.perm_js_domain, "--js-domain")
    perms = permissions_for(
        args.role,
        args.stream,
        args.group,
        api_prefix=api_prefix,
        inbox_prefix=args.perm_inbox_prefix,
        subject_prefix=args.subject_prefix,
    )
    if args.role == "operator" and args.group is None:
        print_err(
            "note: --role operator without --group grants the account's whole JetStream "
            f"API ({api_prefix}.>, $KV.>): give --group G for the narrowest set of one group"
        )
    elif args.role == "watcher" and args.group is None:
        print_err(
            "note: --role watcher without --group covers the nats:// watcher only: give "
            "--group G for the drain sensor and the group's dead-letter watcher"
        )
    if args.format == "json":
        doc = perms.to_json()
        if args.perm_user is not None:
            doc = {"user": args.perm_user, **doc}
        print_json(doc)
    else:
        print(perms.to_conf(args.perm_user), end="")
    return EXIT_OK


COMMAND = Command(
    "permissions",
    "print the exact NATS permissions of a role (publisher, worker, reader, operator, "
    "watcher) as a nats-server config block or JSON",
    configure,
    run,
    "It does not connect to NATS; see docs/security.md for a locked-down deployment.",
    connection_flags=False,
    connects=False,
)
