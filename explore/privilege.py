"""Least privilege in the explorer (``--least-privilege``): one account, one user per role,
every process connected as the user of its role with exactly
:func:`~airflow_nats_ordered.core.admin.permissions.permissions_for`'s set.

The server config holds one account (``EXPLORE``, JetStream enabled) and these users, each
entry rendered by :meth:`RolePermissions.to_conf`, so its password is
``$<USER>_PASSWORD`` from the server's environment (never in the config file):

==================  =================================  ====================================
user                set                                who connects as it
==================  =================================  ====================================
``publisher``       ``publisher`` of the stream        ``publish``, ``publish_run``
``worker``          ``worker`` of the group            ``worker``, ``pool`` (every member)
``operator_g``      ``operator`` with the group        ``group reset``, ``group rebalance``,
                                                       ``dead-letters replay`` / ``purge``,
                                                       every other ``repartition``
``operator``        ``operator`` without a group       ``provision``, ``repartition``,
                    (the account's whole API)          ``group list`` (none has ``--group``)
``watcher``         ``watcher`` of the group           ``status --group`` (with or without
                                                       ``--wait-drained``): the drain
                                                       sensor's reads, read only
``admin``           no permissions block (anything)    the explorer's own reads (the
                                                       stream's last sequence, the dead
                                                       letters to purge, the checker's
                                                       read-back): ``no_auth_user``
==================  =================================  ====================================

``status --group G`` is read only (the group's lag, commits, members: what the drain
sensor reads), so it runs as the watcher, the role that waits for a drain in Airflow;
``group list`` finds the stream's groups by listing the account's streams, which only an
operator may, and has no ``--group``: it runs as the operator without a group, as do
``provision`` and ``repartition`` (neither takes ``--group``). Every other repartition
(the first, the third, ...) runs as the operator of the group instead: docs/security.md
says that narrower set repartitions too, and the explorer's stream has that one group.

The invariant ``no-permission-violation`` (:mod:`explore.checker`) then reads every
command's log for a refusal (``permission denied: ...``, the words of
:class:`~airflow_nats_ordered.core.errors.PermissionDenied` in every interface) and the
server's log for ``Publish Violation`` / ``Subscription Violation`` lines (the server logs
each refusal it sends).
"""

from __future__ import annotations

import json
import re
import secrets
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from airflow_nats_ordered.core.admin.permissions import permissions_for

ACCOUNT = "EXPLORE"
ADMIN = "admin"

#: the user each operation connects as (an operation not named here starts no process of
#: its own, e.g. a leave, which signals one)
OP_USERS: dict[str, str] = {
    "provision": "operator",
    "publish": "publisher",
    "publish-again": "publisher",
    "run": "publisher",
    "run-again": "publisher",
    "worker-join": "worker",
    "pool-join": "worker",
    "repartition": "operator",
    "repartition-g": "operator_g",  # every other repartition (see the module)
    "group-reset": "operator_g",
    "group-rebalance": "operator_g",
    "dead-letters-replay": "operator_g",
    "dead-letters-purge": "operator_g",
    "drain": "watcher",
    "final-drain": "watcher",
    "status": "watcher",  # ``status --group``; ``group list`` runs as ``operator``
    "group-list": "operator",
    # --global-order: the reader of group gg, and the watcher of gg for its drains
    "global-read-join": "reader",
    "global-drain": "watcher_gg",
    "final-global-drain": "watcher_gg",
}

#: user -> (role, with the group?)
USERS: dict[str, tuple[str, bool]] = {
    "publisher": ("publisher", False),
    "worker": ("worker", True),
    "operator_g": ("operator", True),
    "operator": ("operator", False),
    "watcher": ("watcher", True),
}
#: with ``--global-order``, also: user -> role, with the global-order readers' group
GLOBAL_USERS: dict[str, str] = {"reader": "reader", "watcher_gg": "watcher"}

#: what the server logs for each refusal it sends: ``[ERR] ... - "ACCOUNT/user:NAME" - Publish
#: Violation - Subject "SUBJ"`` (or ``Subscription Violation``); the client is sent
#: ``-ERR 'Permissions Violation for Publish to "SUBJ"'``
SERVER_VIOLATION = re.compile(r"(Publish|Subscription|Permissions) Violation")
#: what a client's log says when the server refused it (PermissionDenied in any interface)
CLIENT_DENIAL = re.compile(r"permission denied|permissions violation", re.IGNORECASE)


def password_variable(user: str) -> str:
    """The server environment variable :meth:`RolePermissions.to_conf` takes ``user``'s
    password from."""
    return re.sub(r"[^A-Za-z0-9_]", "_", user).upper() + "_PASSWORD"


class Accounts:
    """The users of one least-privilege run: their passwords (random, per run) and the
    server config block."""

    def __init__(self, stream: str, group: str, global_group: str | None = None) -> None:
        self.stream = stream
        self.group = group
        #: the global-order readers' group (``--global-order``), else None
        self.global_group = global_group
        users = [*USERS, *(GLOBAL_USERS if global_group else ()), ADMIN]
        self.passwords = {u: secrets.token_hex(12) for u in users}

    def server_env(self) -> dict[str, str]:
        """The variables the server reads the passwords from (``$<USER>_PASSWORD``)."""
        return {password_variable(u): p for u, p in self.passwords.items()}

    def client_env(self, user: str) -> dict[str, str]:
        """What a CLI process needs to connect as ``user`` (``NATS_USER``/``NATS_PASSWORD``:
        the password never appears on a command line)."""
        return {"NATS_USER": user, "NATS_PASSWORD": self.passwords[user]}

    def config(self) -> str:
        """The ``accounts`` block and ``no_auth_user`` (the admin: the explorer's reads)."""
        entries = [
            permissions_for(role, self.stream, self.group if grouped else None).to_conf(user)
            for user, (role, grouped) in USERS.items()
        ]
        if self.global_group:
            entries += [
                permissions_for(role, self.stream, self.global_group).to_conf(user)
                for user, role in GLOBAL_USERS.items()
            ]
        entries.append(f"{{ user: {ADMIN}, password: ${password_variable(ADMIN)} }}")
        users = "\n".join(_indent(e, 6) for e in entries)
        return (
            f"accounts {{\n  {ACCOUNT} {{\n    jetstream: enabled\n    users = [\n{users}\n"
            f"    ]\n  }}\n}}\nno_auth_user: {ADMIN}\n"
        )


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line if line else line for line in text.splitlines())


#: the name the explorer's own connections (the admin's reads) go by
CHECKER_NAME = "explore-checker"


def connections(monitor_url: str, timeout: float = 2.0) -> list[tuple[str, str]]:
    """(name, authorized user) of every client connection the server holds now
    (``/connz?auth=1``); empty when the server does not answer."""
    try:
        with urllib.request.urlopen(
            f"{monitor_url}/connz?auth=1&limit=1024", timeout=timeout
        ) as resp:
            data = json.loads(resp.read())
    except (OSError, ValueError):
        return []
    return [
        (str(c.get("name") or ""), str(c.get("authorized_user") or ""))
        for c in data.get("connections") or []
    ]


def wrong_users(conns: Iterable[tuple[str, str]]) -> list[str]:
    """The connections of the explorer's processes (named ``nats-ordered...``, as the CLI,
    the pool's members and ``publish_run_child`` name theirs) that are not a role's user."""
    return [
        f"a process connected as {user or 'nobody'!r}, not its role's user (connection {name!r})"
        for name, user in conns
        if name.startswith("nats-ordered") and user not in USERS and user not in GLOBAL_USERS
    ]


def server_violations(logs: Iterable[Path]) -> list[str]:
    """Every violation line of the server logs (:data:`SERVER_VIOLATION`), each with the
    directory of its log (the server's or the cluster node's)."""
    found: list[str] = []
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found += [
            f"{path.parent.name}: {line.strip()}"
            for line in text.splitlines()
            if SERVER_VIOLATION.search(line)
        ]
    return found


def client_denials(text: str) -> list[str]:
    """The lines of a command's log that report a refused permission."""
    return [line.strip() for line in text.splitlines() if CLIENT_DENIAL.search(line)]
