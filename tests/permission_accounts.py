"""A nats-server config with two accounts and one user per role, for the permission tests.

Accounts ``A`` and ``B`` each hold JetStream; both provision a stream ``ORDERS`` and a group
``G`` of the same names. Every user but the admins has exactly the permission set of its
role as :func:`~airflow_nats_ordered.core.admin.permissions.permissions_for` renders it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from airflow_nats_ordered.core.admin.permissions import permissions_for
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.embedded.servers import NatsServer

S = "ORDERS"
G = "G"  # the group of both accounts
H = "H"  # another group of account A, which A's worker of G may not touch
PASSWORD = "pw-denials"
#: user -> (role, group) in account A (``admin_a`` may do anything, ``noinbox_a`` publish what
#: the operator may but subscribe to no inbox); in B, ``admin_b`` and ``worker_b`` (the
#: worker of G)
ROLES_A: dict[str, tuple[str, str | None]] = {
    "pub_a": ("publisher", None),
    "worker_a": ("worker", G),
    "reader_a": ("reader", G),
    "operator_a": ("operator", G),
    "revocable_a": ("worker", G),  # loses a permission while it runs (revoked=True)
}


def _user(name: str, publish: list[str] | None = None, subscribe: list[str] | None = None) -> str:
    if publish is None or subscribe is None:
        return f"{{ user: {name}, password: {PASSWORD} }}"
    pub = ", ".join(json.dumps(s) for s in publish)
    sub = ", ".join(json.dumps(s) for s in subscribe)
    return (
        f"{{\n user: {name}\n password: {PASSWORD}\n permissions {{\n"
        f"  publish {{ allow: [{pub}] }}\n  subscribe {{ allow: [{sub}] }}\n }}\n}}"
    )


def _role_user(name: str, role: str, group: str | None, drop: str | None = None) -> str:
    perms = permissions_for(role, S, group)
    publish = [s for s in perms.publish_allow if s != drop]
    return _user(name, publish, list(perms.subscribe_allow))


#: the publish permission ``revocable_a`` loses: writing its group's leases
REVOKED = f"$KV.{GroupConfig(S, G).lease_bucket}.>"


def accounts_config(revoked: bool = False) -> str:
    """The ``accounts {}`` block; with ``revoked``, ``revocable_a`` lacks :data:`REVOKED`."""
    users_a = [_user("admin_a")]
    for name, (role, group) in ROLES_A.items():
        drop = REVOKED if revoked and name == "revocable_a" else None
        users_a.append(_role_user(name, role, group, drop))
    # the operator's publishes, but no inbox to receive any answer on
    operator = permissions_for("operator", S, G)
    users_a.append(_user("noinbox_a", list(operator.publish_allow), ["nothing.here"]))
    users_b = [_user("admin_b"), _role_user("worker_b", "worker", G)]
    return (
        "accounts {\n"
        f"  A {{\n    jetstream: enabled\n    users = [\n{chr(10).join(users_a)}\n    ]\n  }}\n"
        f"  B {{\n    jetstream: enabled\n    users = [\n{chr(10).join(users_b)}\n    ]\n  }}\n"
        "}\n"
    )


def options(server: NatsServer, user: str) -> ConnectionOptions:
    return ConnectionOptions(servers=(server.url,), user=user, password=PASSWORD)


def reload(server: NatsServer, config: str) -> None:
    """Apply a new config to the running server (SIGHUP): connected clients keep their
    connection, with the new permissions."""
    server.extra_config = config
    Path(server.config_path).write_text(server.render_config())
    assert server.pid is not None
    os.kill(server.pid, signal.SIGHUP)


@contextlib.contextmanager
def provisioned_server(store: Path) -> Iterator[NatsServer]:
    """A server with :func:`accounts_config`, account A's ``ORDERS`` (4 partitions)
    provisioned by ``admin_a``."""
    with NatsServer(store, extra_config=accounts_config()) as srv:

        async def setup() -> None:
            nc = await connect(options(srv, "admin_a"))
            try:
                await provision(nc, StreamSpec(S, partitions=4))
            finally:
                await nc.close()

        asyncio.run(setup())
        yield srv
