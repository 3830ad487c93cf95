"""The derivation of each role's permission set (issue 31), with plain values: what each role
may touch, and what it may not, by name; the prefixes substituted; bad input refused naming
what is wrong. That the sets are enough to run each job is tests/core/admin/
test_least_privilege.py, against a real nats-server."""

from __future__ import annotations

import re

import pytest

from airflow_nats_ordered.core import ROLES, ConfigError, RolePermissions, permissions_for
from airflow_nats_ordered.core.admin.dlq import dead_letter_stream
from airflow_nats_ordered.core.admin.permissions import js_api_prefix
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.publish.runs import ledger_bucket
from airflow_nats_ordered.core.stream.buckets import watermark_bucket

S, G = "ORDERS", "billing"
LEASES, STATE = GroupConfig(S, G).lease_bucket, GroupConfig(S, G).state_bucket
OTHER = GroupConfig(S, "fraud")


def _all(role: str, group: str | None = G, **kw: str) -> RolePermissions:
    return permissions_for(role, S, group, **kw)


def _pub(perms: RolePermissions) -> set[str]:
    return set(perms.publish_allow)


def test_the_roles_are_named_and_exact() -> None:
    assert ROLES == ("publisher", "worker", "reader", "operator", "watcher")


@pytest.mark.parametrize("role", ["publisher", "worker", "reader", "watcher"])
def test_no_role_but_the_operator_gets_a_broad_wildcard(role: str) -> None:
    perms = _all(role)
    for subject in perms.publish_allow:
        tokens = subject.split(".")
        assert subject not in (">", "$JS.>", "$JS.API.>", "$KV.>", "_INBOX.>"), subject
        assert tokens[0] not in ("*", ">"), subject
        # a wildcard never stands for an API verb, a stream or a bucket
        if tokens[:2] == ["$JS", "API"]:
            assert not {"*", ">"} & set(tokens[2:5]), subject
        if tokens[0] in ("$KV", "$JS") and tokens[1] in ("ACK", "FC"):
            assert tokens[2] not in ("*", ">"), subject
    assert perms.subscribe_allow == ("_INBOX.>",)


@pytest.mark.parametrize("api", ["$JS.API", "$JS.leaf.API"])
@pytest.mark.parametrize("group", [G, None])
@pytest.mark.parametrize("role", ["publisher", "worker", "reader", "watcher"])
def test_no_role_but_the_operator_may_delete_anything(
    role: str, group: str | None, api: str
) -> None:
    """ "A worker cannot delete anything" (issue 31): no consumer, stream, bucket or key
    delete request; a partition reader's consumers end by their inactive threshold."""
    if group is None and role in ("worker", "reader"):
        return
    perms = _all(role, group, api_prefix=api)
    deletes = [s for s in perms.publish_allow if ".DELETE." in s or s.endswith(".DELETE")]
    assert deletes == [], deletes


def test_a_worker_touches_its_group_only_and_never_publishes_into_the_stream() -> None:
    pub = _pub(_all("worker"))
    assert f"$KV.{LEASES}.>" in pub and f"$KV.{STATE}.>" in pub
    assert f"$JS.API.CONSUMER.CREATE.{S}" in pub  # its partition readers
    assert f"$JS.API.CONSUMER.MSG.NEXT.{S}.*" in pub
    assert f"orders.dlq.{G}.*" in pub  # its dead letters, not other groups'
    assert f"$JS.API.STREAM.CREATE.{dead_letter_stream(S)}" in pub
    joined = "\n".join(pub)
    assert OTHER.lease_bucket not in joined and OTHER.state_bucket not in joined
    assert "orders.p." not in joined  # cannot publish records
    assert not re.search(r"\.(DELETE|PURGE)\.(?!ORDERS\.\*)", joined), joined  # deletes nothing
    assert ledger_bucket(S) not in joined and watermark_bucket(S) not in joined


def test_a_publisher_writes_the_stream_and_its_ledger_and_no_group_state() -> None:
    pub = _pub(permissions_for("publisher", S))
    assert "orders.p.*" in pub  # every partition, every layout epoch
    assert f"$KV.{ledger_bucket(S)}.>" in pub
    assert f"$JS.API.STREAM.CREATE.KV_{ledger_bucket(S)}" in pub
    assert f"$KV.{watermark_bucket(S)}.>" in pub  # global order's watermarks
    joined = "\n".join(pub)
    assert "_leases" not in joined and "_state" not in joined
    assert "CONSUMER" not in joined and "DELETE" not in joined and "PURGE" not in joined


def test_a_reader_publishes_nothing_and_only_reads_the_watermarks() -> None:
    pub = _pub(_all("reader"))
    joined = "\n".join(pub)
    assert "orders.p." not in joined
    assert f"$JS.API.STREAM.MSG.GET.KV_{watermark_bucket(S)}" in pub
    assert f"$KV.{watermark_bucket(S)}.>" not in pub
    assert f"$KV.{STATE}.>" in pub  # its position


def test_the_watcher_writes_no_state_and_acks_only_its_streams() -> None:
    pub = _pub(_all("watcher"))
    joined = "\n".join(pub)
    assert "$KV." not in joined and "orders.p." not in joined
    assert f"$JS.API.CONSUMER.CREATE.KV_{STATE}" in pub  # the drain watches commits
    assert f"$JS.ACK.{S}.>" in pub and f"$JS.ACK.{dead_letter_stream(S)}.>" in pub
    # the dead-letter watcher's consumer is created on its group's subjects only
    assert f"$JS.API.CONSUMER.CREATE.{dead_letter_stream(S)}.*.orders.dlq.{G}.*" in pub
    assert not any(
        s.startswith("$JS.API.STREAM.") and "INFO" not in s and "MSG.GET" not in s for s in pub
    ), joined
    without = _pub(permissions_for("watcher", S))
    assert not any("_state" in s or "_leases" in s for s in without)


def test_the_operator_is_scoped_to_one_group_when_given_one() -> None:
    scoped = _pub(_all("operator"))
    assert "$JS.API.>" not in scoped and "$KV.>" not in scoped
    for subject in (
        f"$JS.API.STREAM.CREATE.{S}",
        f"$JS.API.STREAM.UPDATE.{S}",
        f"$JS.API.STREAM.DELETE.KV_{LEASES}",
        f"$JS.API.STREAM.DELETE.KV_{STATE}",
        f"$JS.API.STREAM.PURGE.{dead_letter_stream(S)}",
        f"$JS.API.STREAM.MSG.DELETE.{dead_letter_stream(S)}",  # purge --seq, replay --purge
        "$JS.API.STREAM.LIST",
        "orders.p.*",  # replays
    ):
        assert subject in scoped, subject
    assert f"$JS.API.STREAM.DELETE.{S}" not in scoped  # no operation deletes the stream
    assert not any(OTHER.state_bucket in s for s in scoped)
    broad = _pub(permissions_for("operator", S))
    assert {"$JS.API.>", "$KV.>"} <= broad


@pytest.mark.parametrize("role", ROLES)
def test_the_api_and_inbox_prefixes_are_substituted(role: str) -> None:
    api = js_api_prefix("hub")
    assert api == "$JS.hub.API"
    plain = _all(role)
    moved = _all(role, api_prefix=api, inbox_prefix="_INBOX_billing")
    assert moved.subscribe_allow == ("_INBOX_billing.>",)
    # KV writes go through the prefix too (connection.api.kv_subject), other subjects keep
    # their names; the operator's whole-API grant already holds its KV writes
    assert moved.publish_allow == tuple(
        api + s.removeprefix("$JS.API")
        if s.startswith("$JS.API")
        else f"{api}.{s}"
        if s.startswith("$KV.") and s != "$KV.>"
        else s
        for s in plain.publish_allow
        if s != "$KV.>"
    )


def test_the_subject_prefix_of_the_stream_is_used() -> None:
    pub = _pub(permissions_for("publisher", S, subject_prefix="eu.orders"))
    assert "eu.orders.p.*" in pub and "orders.p.*" not in pub
    assert f"eu.orders.dlq.{G}.*" in _pub(_all("worker", subject_prefix="eu.orders"))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("admin", S, G), {}, "unknown role 'admin': use one of publisher, worker"),
        (("worker", S), {}, "role worker needs a consumer group"),
        (("reader", S), {}, "role reader needs a consumer group"),
        (("worker", "ORD.ERS", G), {}, "stream name 'ORD.ERS' is not valid"),
        (("worker", S, "a.b"), {}, "group name 'a.b' is not valid"),
        (("worker", S, G), {"subject_prefix": "o.*"}, "subject prefix 'o.*' is not valid"),
        (("worker", S, G), {"api_prefix": "$JS.>"}, "api_prefix '$JS.>' is not valid"),
        (("worker", S, G), {"inbox_prefix": "a b"}, "inbox_prefix 'a b' is not valid"),
    ],
)
def test_bad_input_is_refused_naming_what_is_wrong(
    args: tuple[str, ...], kwargs: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        permissions_for(*args, **kwargs)  # type: ignore[arg-type]
    assert message in str(refused.value)


def test_every_subject_has_its_reason_and_the_conf_block_lists_each_once() -> None:
    perms = _all("worker")
    for subject in perms.publish_allow + perms.subscribe_allow:
        assert perms.reasons[subject], subject
    conf = perms.to_conf()
    assert conf.startswith(f"# role worker of stream {S}, group {G}\npermissions {{")
    for subject in perms.publish_allow:
        assert conf.count(f'"{subject}"  # ') == 1, subject
    entry = perms.to_conf("billing-worker-1")
    assert '  user: "billing-worker-1"\n  password: $BILLING_WORKER_1_PASSWORD\n' in entry
    with pytest.raises(ConfigError, match="user name 'a b' is not valid"):
        perms.to_conf("a b")


def test_the_json_form_is_the_same_set() -> None:
    perms = _all("watcher")
    doc = perms.to_json()
    assert doc == {
        "role": "watcher",
        "stream": S,
        "group": G,
        "permissions": {
            "publish": {"allow": list(perms.publish_allow)},
            "subscribe": {"allow": list(perms.subscribe_allow)},
        },
    }


# ---------------------------------------------------------------------------- docs/protocol.md

PAGE_ROLES = (
    ("publisher", None),
    ("worker", G),
    ("reader", G),
    ("watcher", G),
    ("operator", G),
)


def protocol_tables() -> str:
    """Section 13's tables of docs/protocol.md, from ``permissions_for`` (stream ORDERS,
    group billing): what the page between its ``permissions-table`` markers must be."""
    out = []
    for role, group in PAGE_ROLES:
        perms = permissions_for(role, S, group)
        head = f"`{role}`" + (f" (group `{group}`)" if group else "")
        out += [f"**{head}**", "", "| | subject | why |", "|---|---|---|"]
        for kind, subjects in (("pub", perms.publish_allow), ("sub", perms.subscribe_allow)):
            for subject in subjects:
                why = perms.reasons[subject].replace("|", "\\|")
                out.append(f"| {kind} | `{subject}` | {why} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def test_protocol_page_lists_the_subjects_each_role_is_given() -> None:
    """docs/protocol.md section 13 is the function's output; on a change, paste what this
    prints (``python -c 'import test_permissions as t; print(t.protocol_tables())'`` from
    tests/core/admin) between the markers."""
    from protocol_page import page_text

    m = re.search(
        r"<!-- permissions-table: begin[^>]*-->\n(.*?)<!-- permissions-table: end -->",
        page_text(),
        re.S,
    )
    assert m, "docs/protocol.md has no permissions-table markers"
    assert m.group(1) == protocol_tables(), protocol_tables()
