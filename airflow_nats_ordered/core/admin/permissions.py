"""Least privilege: the exact NATS subjects each role of a pipeline may publish and subscribe.

A role is one principal of a deployment (a NATS user), doing one job on one stream ``S``
(and, for most roles, one consumer group ``G``):

``publisher``
    publishes records into ``S`` (fast batches, their replies), keeps the stream's run
    ledger ``nor_<S>_runs`` and, for global order, the watermark bucket ``nor_<S>_global``.
``worker``
    a member of group ``G`` (a worker or a pool): its partition consumers on ``S``, the
    group's leases, commits, heartbeats, presence and assignment in ``nor_<S>_<G>_leases``
    and ``nor_<S>_<G>_state``, the dead letters it writes to ``<S>_DLQ``.
``reader``
    a :class:`~..order.reader.GlobalOrderReader` of ``S`` in group ``G``: its consumers on
    ``S``, its position and heartbeat in the group's buckets, the producers' marks and
    watermarks in ``nor_<S>_global`` (read only), the records it sets aside in ``<S>_DLQ``.
``operator``
    provisions and repartitions ``S``, resets, rebalances, lists and deletes its groups,
    reads, replays and purges dead letters. With ``group`` the grant covers that group
    only; without, every group of the stream, which NATS can only say as the account's
    whole JetStream API (``$JS.API.>``, ``$KV.>``): the account is then the boundary.
``watcher``
    the Airflow triggerer: the drain sensor's reads of group ``G``'s lag and commits
    (read only), the ``nats://`` message-queue watcher's durable consumer on ``S`` and the
    group's dead-letter watcher's on ``<S>_DLQ``.

:func:`permissions_for` derives each set from the names the code uses (the stream wing's
bucket names, :class:`~..group.config.GroupConfig`, the dead-letter stream, the run
ledger), and ``tests/core/admin/test_least_privilege.py`` proves each one against a real
nats-server: every job runs as a user with exactly its set and no permission violation.
It is pure: nothing here connects to NATS. Every subject comes with the reason it is
needed (:attr:`RolePermissions.reasons`), which :meth:`RolePermissions.to_conf` writes as
comments and ``docs/security.md`` explains.

``api_prefix`` is the JetStream API prefix (``$JS.API``, or ``$JS.<domain>.API`` for a
JetStream domain: it replaces ``$JS.API`` in every API subject; ``$JS.ACK.`` and
``$JS.FC.`` subjects keep their names, and KV writes go to ``<api_prefix>.$KV.<bucket>.>``
under any prefix but the default, as the client sends them: see
:mod:`~..connection.api`); ``inbox_prefix`` the client's inbox prefix
(``_INBOX``), under which every request's reply arrives. Both must match the connection's
settings. ``subject_prefix`` is the stream's, when it was provisioned with one.

The sets are narrowed to the calls the code makes, not to what a role might conceivably
do; a few lines serve paths a test run may not take (a bucket that allows direct gets,
replicas raised, strays, a rebalance by load): each says so in its reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from airflow_nats_ordered.core.admin.dlq import dead_letter_stream
from airflow_nats_ordered.core.connection.api import (
    DEFAULT_API_PREFIX,
    domain_api_prefix,
    write_subject,
)
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.runs import ledger_bucket
from airflow_nats_ordered.core.stream.buckets import watermark_bucket
from airflow_nats_ordered.core.stream.partitioned import STREAM_NAME_RULE, check_stream_name
from airflow_nats_ordered.core.stream.repartition import lock_bucket

#: the roles, in the order the docs list them
ROLES: tuple[str, ...] = ("publisher", "worker", "reader", "operator", "watcher")

#: roles that act for one consumer group and need ``group``
GROUP_ROLES: frozenset[str] = frozenset({"worker", "reader"})

_TOKEN = r"[A-Za-z0-9_-]+"
_PREFIX = re.compile(rf"^{_TOKEN}(\.{_TOKEN})*$")
_GROUP = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DOMAIN = re.compile(rf"^{_TOKEN}$")
#: an API or inbox prefix such as ``$JS.API``, ``$JS.hub.API`` or ``_INBOX_billing``: plain
#: tokens (the first may start with ``$``), no wildcards
_SUBJECT_PREFIX = re.compile(rf"^\$?{_TOKEN}(\.{_TOKEN})*$")
_USER = re.compile(r"^[A-Za-z0-9_.@-]+$")


def check_subject_prefix(value: str, name: str = "subject prefix") -> str:
    """``value`` if it is a stream's subject prefix (dot-separated tokens), else
    ConfigError naming ``name`` (the interface's word for it: ``--subject-prefix``)."""
    if not isinstance(value, str) or not _PREFIX.fullmatch(value):
        raise ConfigError(
            f"{name} {value!r} is not valid: dot-separated tokens of letters, digits, "
            "'_' or '-' (no wildcards or blanks)"
        )
    return value


def check_prefix(value: str, name: str) -> str:
    """``value`` if it is a JetStream API prefix or an inbox prefix (``$JS.API``,
    ``$JS.hub.API``, ``_INBOX``), else ConfigError naming ``name``."""
    if not isinstance(value, str) or not _SUBJECT_PREFIX.fullmatch(value):
        raise ConfigError(
            f"{name} {value!r} is not valid: dot-separated tokens of letters, digits, "
            "'_' or '-' (the first may start with '$'), no wildcards or blanks"
        )
    return value


def js_api_prefix(domain: str | None, name: str = "JetStream domain") -> str:
    """The JetStream API prefix of ``domain``: ``$JS.<domain>.API``, or ``$JS.API``."""
    if domain and (not isinstance(domain, str) or not _DOMAIN.fullmatch(domain)):
        raise ConfigError(
            f"{name} {domain!r} is not valid: one token of letters, digits, '_' or '-'"
        )
    return domain_api_prefix(domain)


def check_user(value: str, name: str = "user name") -> str:
    """``value`` if it may name a user entry of the server config, else ConfigError."""
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise ConfigError(f"{name} {value!r} is not valid: letters, digits, '_', '-', '.' or '@'")
    return value


@dataclass(frozen=True)
class RolePermissions:
    """What one role may publish and subscribe to, each subject with why it is needed.

    ``publish_allow`` and ``subscribe_allow`` are the nats-server ``allow`` lists; the deny
    lists are empty for every role today (an allow list already denies the rest) and are
    rendered when set. ``reasons`` maps each subject to one line saying why the role needs
    it (shown as comments by :meth:`to_conf`).
    """

    role: str
    stream: str
    group: str | None
    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> dict[str, Any]:
        """A nats-server ``permissions`` object as JSON (the shape of the config block)."""
        perms: dict[str, Any] = {
            "publish": {"allow": list(self.publish_allow)},
            "subscribe": {"allow": list(self.subscribe_allow)},
        }
        if self.publish_deny:
            perms["publish"]["deny"] = list(self.publish_deny)
        if self.subscribe_deny:
            perms["subscribe"]["deny"] = list(self.subscribe_deny)
        return {
            "role": self.role,
            "stream": self.stream,
            "group": self.group,
            "permissions": perms,
        }

    def to_conf(self, user: str | None = None) -> str:
        """The ``permissions { ... }`` block of a nats-server config, one subject a line
        with the reason as a comment; with ``user``, a whole user entry
        (``{ user: NAME, password: $NAME_PASSWORD, permissions { ... } }``) to paste into an
        ``authorization { users = [...] }`` or ``accounts { A { users = [...] } }`` list."""
        head = f"# role {self.role} of stream {self.stream}"
        if self.group is not None:
            head += f", group {self.group}"
        body = [
            "permissions {",
            *_conf_list("publish", self.publish_allow, self.publish_deny, self.reasons),
            *_conf_list("subscribe", self.subscribe_allow, self.subscribe_deny, self.reasons),
            "}",
        ]
        if user is None:
            return "\n".join([head, *body]) + "\n"
        check_user(user)
        variable = re.sub(r"[^A-Za-z0-9_]", "_", user).upper() + "_PASSWORD"
        return (
            "\n".join(
                [
                    head,
                    "{",
                    f"  user: {_quote(user)}",
                    f"  password: ${variable}",
                    *("  " + line for line in body),
                    "}",
                ]
            )
            + "\n"
        )


def _quote(subject: str) -> str:
    return json.dumps(subject)


def _conf_list(
    what: str, allow: tuple[str, ...], deny: tuple[str, ...], reasons: dict[str, str]
) -> list[str]:
    lines = [f"  {what} {{"]
    for key, subjects in (("allow", allow), ("deny", deny)):
        if not subjects and key == "deny":
            continue
        lines.append(f"    {key}: [")
        for s in subjects:
            why = reasons.get(s)
            lines.append(f"      {_quote(s)}" + (f"  # {why}" if why else ""))
        lines.append("    ]")
    lines.append("  }")
    return lines


class _Grant:
    """Collects subjects (in order, once) with the reason each is needed."""

    def __init__(self, api: str, inbox: str) -> None:
        self.api = api
        self.inbox = inbox
        self.pub: dict[str, str] = {}
        self.sub: dict[str, str] = {}

    def p(self, subject: str, why: str) -> None:
        self.pub.setdefault(subject, why)

    def s(self, subject: str, why: str) -> None:
        self.sub.setdefault(subject, why)

    # streams ---------------------------------------------------------------------------

    def replies(self) -> None:
        self.s(
            f"{self.inbox}.>",
            "the replies to every request: JetStream API answers, publish and KV write acks, "
            "pulled records",
        )

    def info(self, stream: str, what: str) -> None:
        self.p(f"{self.api}.STREAM.INFO.{stream}", f"read {what}'s configuration and state")

    def msg_get(self, stream: str, what: str, why: str) -> None:
        self.p(f"{self.api}.STREAM.MSG.GET.{stream}", f"get a record of {what}: {why}")

    def direct_last(self, stream: str, what: str, why: str) -> None:
        self.p(
            f"{self.api}.DIRECT.GET.{stream}.>",
            f"direct get of a subject's last record in {what}: {why}",
        )

    def direct_count(self, stream: str, what: str) -> None:
        self.p(
            f"{self.api}.DIRECT.GET.{stream}",
            f"batch direct get on {what}: the server counts the records after a position (lag)",
        )

    def readers(self, stream: str, what: str) -> None:
        """The unnamed, filtered pull consumers a partition reader makes and pulls (never
        deletes: each ends by its inactive threshold once its reader stops)."""
        self.p(
            f"{self.api}.CONSUMER.CREATE.{stream}",
            f"create the unnamed consumer that reads a partition of {what}",
        )
        self.p(
            f"{self.api}.CONSUMER.MSG.NEXT.{stream}.*",
            f"pull records from those consumers of {what}",
        )

    # KV buckets ------------------------------------------------------------------------

    def kv_read(self, bucket: str) -> None:
        kv = f"KV_{bucket}"
        self.info(kv, f"bucket {bucket}")
        self.msg_get(kv, f"bucket {bucket}", "a key's latest value")
        self.direct_last(
            kv,
            f"bucket {bucket}",
            "a key's latest value, when the bucket allows direct gets (as one made by "
            "`nats kv add` does)",
        )

    def kv_watch(self, bucket: str) -> None:
        kv = f"KV_{bucket}"
        self.p(
            f"{self.api}.CONSUMER.CREATE.{kv}",
            f"watch bucket {bucket} (an ordered consumer of its changes)",
        )
        self.p(f"{self.api}.CONSUMER.INFO.{kv}.*", f"the watch of {bucket}: its pending count")
        self.p(f"$JS.FC.{kv}.>", f"flow-control answers of the watch of {bucket}")

    def kv_write(self, bucket: str, what: str) -> None:
        self.kv_read(bucket)
        self.p(
            write_subject(self.api, f"$KV.{bucket}.>"),
            f"write {what} in {bucket} (put, compare-and-set, delete)",
        )

    def kv_create(self, bucket: str, *, update: bool = False) -> None:
        kv = f"KV_{bucket}"
        self.p(f"{self.api}.STREAM.CREATE.{kv}", f"create bucket {bucket} when it is missing")
        if update:
            self.p(
                f"{self.api}.STREAM.UPDATE.{kv}",
                f"raise bucket {bucket}'s replicas when more are asked for",
            )

    def done(self, role: str, stream: str, group: str | None) -> RolePermissions:
        return RolePermissions(
            role=role,
            stream=stream,
            group=group,
            publish_allow=tuple(self.pub),
            subscribe_allow=tuple(self.sub),
            reasons={**self.sub, **self.pub},
        )


def permissions_for(
    role: str,
    stream: str,
    group: str | None = None,
    *,
    api_prefix: str = "$JS.API",
    inbox_prefix: str = "_INBOX",
    subject_prefix: str | None = None,
) -> RolePermissions:
    """The exact publish and subscribe allow lists of ``role`` on ``stream`` (and ``group``).

    ``group`` is required by ``worker`` and ``reader``; a ``watcher`` without one may only
    watch messages (no drain sensor, no dead-letter watcher); an ``operator`` without one
    administers every group of the stream, which NATS can only grant as the account's whole
    JetStream API. ``subject_prefix`` is the stream's (default: the stream name in lower
    case, as ``provision`` makes it). ``api_prefix`` is ``$JS.API`` or, for a JetStream
    domain, ``$JS.<domain>.API`` (:func:`js_api_prefix`); ``inbox_prefix`` the clients'
    inbox prefix. Raises :class:`~..errors.ConfigError` naming what is wrong: an unknown
    role, a missing or invalid group, an invalid stream name or prefix.
    """
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    try:
        check_stream_name(stream)
    except ConfigError:
        raise ConfigError(f"stream name {stream!r} is not valid: use {STREAM_NAME_RULE}") from None
    if group is None and role in GROUP_ROLES:
        raise ConfigError(f"role {role} needs a consumer group: give the group it works for")
    if group is not None and (not isinstance(group, str) or not _GROUP.fullmatch(group)):
        raise ConfigError(f"group name {group!r} is not valid: 1-64 letters, digits, '_' or '-'")
    pre = check_subject_prefix(stream.lower() if subject_prefix is None else subject_prefix)
    check_prefix(api_prefix, "api_prefix")
    check_prefix(inbox_prefix, "inbox_prefix")
    g = _Grant(api_prefix, inbox_prefix)
    g.replies()
    build = {
        "publisher": _publisher,
        "worker": _worker,
        "reader": _reader,
        "operator": _operator,
        "watcher": _watcher,
    }[role]
    build(g, stream, group, pre)
    return g.done(role, stream, group)


def _publisher(g: _Grant, stream: str, group: str | None, prefix: str) -> None:
    what = f"stream {stream}"
    g.info(stream, what)
    g.direct_last(stream, what, "each partition's last record, where a run resumes")
    g.msg_get(stream, what, "each partition's last record, for global order's watermarks")
    g.p(f"{prefix}.p.*", f"publish records to the partitions of {stream}, every layout epoch")
    ledger, marks = ledger_bucket(stream), watermark_bucket(stream)
    g.kv_write(ledger, "the runs' records")
    g.kv_create(ledger)
    g.kv_write(marks, "global order's sequencer claim, watermarks and producer marks")
    g.kv_create(marks)


def _group_writes(g: _Grant, stream: str, group: str) -> None:
    cfg = GroupConfig(stream, group)
    g.kv_write(cfg.lease_bucket, f"group {group}'s leases, heartbeats and presence")
    g.kv_create(cfg.lease_bucket, update=True)
    g.kv_write(cfg.state_bucket, f"group {group}'s commits, fencing tokens and assignment")
    g.kv_create(cfg.state_bucket, update=True)


def _dead_letters_written(g: _Grant, stream: str, group: str, prefix: str) -> None:
    dlq = dead_letter_stream(stream)
    g.info(dlq, f"dead-letter stream {dlq}")
    g.p(f"{g.api}.STREAM.CREATE.{dlq}", f"create {dlq} on the first dead letter")
    g.p(f"{prefix}.dlq.{group}.*", f"write group {group}'s dead letters")


def _worker(g: _Grant, stream: str, group: str | None, prefix: str) -> None:
    assert group is not None
    what = f"stream {stream}"
    g.info(stream, what)
    g.msg_get(stream, what, "the record at a committed position, to check continuity")
    g.direct_last(stream, what, "an earlier layout's last records, to switch epochs")
    g.readers(stream, what)
    _group_writes(g, stream, group)
    _dead_letters_written(g, stream, group, prefix)


def _reader(g: _Grant, stream: str, group: str | None, prefix: str) -> None:
    assert group is not None
    what = f"stream {stream}"
    g.info(stream, what)
    g.msg_get(stream, what, "each partition's last record, for the merge's bounds")
    g.readers(stream, what)
    g.kv_read(watermark_bucket(stream))
    _group_writes(g, stream, group)
    _dead_letters_written(g, stream, group, prefix)


def _durable(g: _Grant, stream: str, create: str, what: str) -> None:
    """The ``nats://`` watcher's durable consumer on ``stream`` (``airflow-watcher-<hash>``,
    ``airflow-dlq-<group>`` or the durable named): created under ``create``, bound, pulled
    from, its messages acknowledged."""
    g.p(create, f"create the watcher's durable consumer on {what}")
    g.p(
        f"{g.api}.CONSUMER.INFO.{stream}.*",
        f"read the watcher's durable consumer on {what} (its binding, its position)",
    )
    g.p(
        f"{g.api}.CONSUMER.MSG.NEXT.{stream}.*",
        f"pull messages from the watcher's durable consumer on {what}",
    )
    g.p(
        f"$JS.ACK.{stream}.>",
        f"acknowledge (ack, nak, term, in progress) the messages of {what} handed to Airflow",
    )


def _watcher(g: _Grant, stream: str, group: str | None, prefix: str) -> None:
    what = f"stream {stream}"
    g.p(f"{g.api}.INFO", "the Airflow connection's test: the account's JetStream limits")
    g.info(stream, what)
    _durable(g, stream, f"{g.api}.CONSUMER.CREATE.{stream}.>", what)
    if group is None:
        return
    g.msg_get(stream, what, "the first and last stray record (the drain reports strays)")
    g.direct_last(stream, what, "the last record on each subject (strays)")
    g.direct_count(stream, what)
    cfg = GroupConfig(stream, group)
    g.kv_read(cfg.lease_bucket)
    g.kv_read(cfg.state_bucket)
    g.kv_watch(cfg.state_bucket)
    dlq = dead_letter_stream(stream)
    g.info(dlq, f"dead-letter stream {dlq}")
    _durable(
        g,
        dlq,
        f"{g.api}.CONSUMER.CREATE.{dlq}.*.{prefix}.dlq.{group}.*",
        f"group {group}'s dead letters in {dlq}",
    )


def _operator(g: _Grant, stream: str, group: str | None, prefix: str) -> None:
    api = g.api
    if group is None:
        g.p(f"{api}.>", "administer every stream, bucket and consumer of the account")
        if api == DEFAULT_API_PREFIX:  # under another prefix, f"{api}.>" has the writes
            g.p("$KV.>", "write the keys of every group's buckets")
        g.p("$JS.FC.>", "flow-control answers of the watches of every bucket")
        g.p(f"{prefix}.p.*", f"replay dead letters into the partitions of {stream}")
        return
    what = f"stream {stream}"
    g.p(f"{api}.STREAM.NAMES", "find streams whose subjects overlap, when provisioning")
    g.p(f"{api}.STREAM.LIST", "list the account's streams, to find the stream's groups")
    g.info(stream, what)
    g.p(f"{api}.STREAM.CREATE.{stream}", f"create {what} (provision)")
    g.p(f"{api}.STREAM.UPDATE.{stream}", f"update {what} (provision again, repartition)")
    g.p(f"{api}.STREAM.PURGE.{stream}", f"purge the strays of {what}")
    g.msg_get(stream, what, "the records a reset lands on, strays")
    g.direct_last(stream, what, "the last record on each subject (strays)")
    g.direct_count(stream, what)
    g.p(
        f"{api}.CONSUMER.CREATE.{stream}",
        f"a rebalance by load counts each partition's rate of {what} with an unnamed consumer",
    )
    g.p(f"{api}.CONSUMER.DELETE.{stream}.*", "delete those counting consumers at once")
    dlq = dead_letter_stream(stream)
    g.info(dlq, f"dead-letter stream {dlq}")
    g.msg_get(dlq, f"dead-letter stream {dlq}", "read, show and replay dead letters")
    g.p(f"{api}.STREAM.PURGE.{dlq}", f"purge group {group}'s dead letters from {dlq}")
    g.p(
        f"{api}.STREAM.MSG.DELETE.{dlq}",
        f"remove chosen dead letters of group {group} from {dlq}, each by its sequence "
        "(purge --seq, replay --purge)",
    )
    g.p(f"{api}.STREAM.DELETE.{dlq}", f"delete {dlq} once the last group's letters are gone")
    g.kv_read(ledger_bucket(stream))
    g.kv_read(watermark_bucket(stream))
    lock = lock_bucket(stream)
    g.kv_write(lock, "the repartition lock")
    g.kv_create(lock)
    cfg = GroupConfig(stream, group)
    g.kv_write(
        cfg.lease_bucket,
        f"group {group}'s leases (a reset deletes the lease of each partition it moves, so "
        "an idle holder notices at its next renewal)",
    )
    g.kv_write(cfg.state_bucket, f"group {group}'s reset positions and rebalance requests")
    g.kv_watch(cfg.state_bucket)
    for bucket in (cfg.lease_bucket, cfg.state_bucket):
        g.p(f"{api}.STREAM.DELETE.KV_{bucket}", f"delete group {group}'s bucket {bucket}")
    g.p(f"{prefix}.p.*", f"replay dead letters into the partitions of {stream}")
