"""The explorer's checker on fabricated histories (plain values): each invariant passes on
a clean history and fails on one that breaks it, so no checker is one that cannot fail."""

from __future__ import annotations

import sys

import pytest
from locations import ROOT

sys.path.insert(0, str(ROOT))

from explore.checker import (  # noqa: E402
    INVARIANTS,
    AppliedRecord,
    DrainClaim,
    Facts,
    GlobalStored,
    Handover,
    InputRecord,
    LagClaim,
    MemberExit,
    PublishReport,
    ReaderRun,
    StoredRecord,
    check,
)
from explore.known import KNOWN_DEFECTS, SKIPPED_INVARIANTS, parse_skip  # noqa: E402

# producer "a": key x #0 #1 #2 (gids 1-3), key y #0 (gid 4), a poison record (gid 5)
INPUTS = [
    InputRecord(1, "a", "x", 0),
    InputRecord(2, "a", "x", 1),
    InputRecord(3, "a", "x", 2),
    InputRecord(4, "a", "y", 0),
    InputRecord(5, "a", "poison-5", 0, poison=True),
]


def clean() -> Facts:
    """Published once (alone), stored once in order, applied once in order, the poison
    record dead-lettered and replayed (seq 6), drained, the lag of the last record exact."""
    stored = [StoredRecord(seq, "explore.p.0", gid) for seq, gid in enumerate([1, 2, 4, 3, 5], 1)]
    stored.append(StoredRecord(6, "explore.p.0", 5, replay=True))
    applied = [
        AppliedRecord(i, gid, seq)
        for i, (gid, seq) in enumerate([(1, 1), (2, 2), (4, 3), (3, 4), (5, 6)], 1)
    ]
    return Facts(
        inputs=list(INPUTS),
        stored=stored,
        applied=applied,
        publishes=[PublishReport(10, "cli", "a", 5, True, True, acked=5, alone=True)],
        drains=[DrainClaim(11, high_water=6, applied_upto=5)],
        lags=[LagClaim("status", 0, drained_upto=6)],
    )


def names(facts: Facts, skip: frozenset[str] = frozenset()) -> set[str]:
    return {v.invariant for v in check(facts, skip=skip)}


def test_a_clean_history_has_no_violation():
    assert check(clean()) == []


def test_a_record_stored_twice_breaks_stored_once():
    f = clean()
    f.stored.append(StoredRecord(7, "explore.p.e1-0", 4))  # after a repartition, again
    found = check(f)
    assert "stored-once" in {v.invariant for v in found}
    assert any(
        "a: 1 of its 5 records are stored more than once (layout epochs e0/e1); e.g. y#0 at "
        "seqs [3, 7]" in v.message
        for v in found
    )


def test_a_dead_letter_replayed_twice_breaks_stored_once():
    f = clean()
    f.stored.append(StoredRecord(7, "explore.p.0", 5, replay=True))
    f.lags = []
    found = check(f)
    assert [v.message for v in found] == [
        "dead letter gid 5 was replayed and stored 2 times: [6, 7]"
    ]


def test_a_per_key_inversion_in_the_stream_breaks_stream_key_order():
    f = clean()
    f.stored[0], f.stored[1] = StoredRecord(1, "explore.p.0", 2), StoredRecord(2, "explore.p.0", 1)
    assert "stream-key-order" in names(f)


def test_a_gap_breaks_no_gap():
    f = clean()
    f.stored = [s for s in f.stored if s.gid != 2]  # x#1 missing, x#2 stored
    f.publishes = []
    assert "no-gap" in names(f)


def test_a_successful_publish_with_a_missing_record_breaks_complete_stored():
    f = clean()
    f.stored = [s for s in f.stored if s.gid != 3]  # x#2 (the last of x) missing
    assert "complete-stored" in names(f)


def test_a_per_key_inversion_in_the_sink_breaks_sink_key_order():
    f = clean()
    f.applied = [AppliedRecord(1, 2, 2), AppliedRecord(2, 1, 1), *f.applied[2:]]
    assert names(f) == {"sink-key-order"}


def test_a_record_applied_twice_breaks_applied_once():
    f = clean()
    f.applied.append(AppliedRecord(6, 1, 1))  # the same stream message again
    assert "applied-once" in names(f)
    g = clean()
    g.stored.append(StoredRecord(7, "explore.p.0", 1))  # a duplicate, applied too
    g.applied.append(AppliedRecord(6, 1, 7))
    assert "applied-once" in names(g, skip=frozenset({"stored-once"}))


def test_drained_before_everything_was_applied_breaks_drained_applied():
    f = clean()
    f.drains = [DrainClaim(11, high_water=6, applied_upto=3)]  # seq 4 and the replay not yet
    found = check(f)
    assert {v.invariant for v in found} == {"drained-applied"}
    assert "seqs [4, 6]" in found[0].message


def test_a_lost_poison_record_breaks_dead_letter_kept():
    f = clean()
    f.applied = [a for a in f.applied if a.gid != 5]
    f.drains = []
    assert names(f) == {"dead-letter-kept"}
    f.dead_letters = {5}  # still a dead letter: fine
    assert names(f) == set()
    f.dead_letters, f.purged = set(), {5}  # purged on purpose: fine
    assert names(f) == set()


def test_an_overstated_lag_breaks_lag_exact_unless_skipped():
    f = clean()
    f.stored.append(StoredRecord(7, "explore.p.0", 99))
    f.inputs.append(InputRecord(99, "b", "x", 0))
    f.lags = [LagClaim("status", 1, drained_upto=6), LagClaim("group list", 3, drained_upto=6)]
    found = check(f)
    assert [v.invariant for v in found] == ["lag-exact"]
    assert "group list reports lag 3, but 1 stored record(s) are not applied" in found[0].message
    skip = frozenset({"lag-exact"})  # what a known defect's SKIPPED_INVARIANTS entry does
    assert check(f, skip=skip) == []


def test_counts_that_differ_from_the_server_break_counts():
    f = clean()
    f.publishes = [PublishReport(10, "cli", "a", 5, True, True, acked=4, alone=True)]
    assert names(f) == {"counts"}
    # published twice, alone: the second reports every record a duplicate
    g = clean()
    g.publishes.append(
        PublishReport(12, "cli", "a", 5, True, True, acked=5, duplicates=5, alone=True)
    )
    assert check(g) == []
    g.publishes[-1] = PublishReport(
        12, "cli", "a", 5, True, True, acked=5, duplicates=3, alone=True
    )
    assert names(g) == {"counts"}  # exact when alone
    g.publishes = [dataclass_replace(p, alone=False) for p in g.publishes]
    assert check(g) == []  # another writer may hide duplicates...
    g.publishes[-1] = PublishReport(12, "cli", "a", 5, True, True, acked=5, duplicates=6)
    assert names(g) == {"counts"}  # ... never invent them


def test_a_hung_command_breaks_liveness():
    f = clean()
    f.liveness = ["#7 run still running 200s after its start (deadline 150s)"]
    assert names(f) == {"liveness"}


def test_a_member_that_exits_on_its_own_breaks_member_exit():
    f = clean()
    f.members = [
        MemberExit(3, "worker-join", -9, killed=True),  # the nemesis
        MemberExit(4, "worker-join", 0, leaving=True),  # SIGTERM, left
        MemberExit(5, "pool-join", 0, leaving=True),
        MemberExit(9, "worker-join", 2, joined=False),  # could not start: documented
    ]
    assert check(f) == []
    f.members.append(MemberExit(6, "worker-join", 3, tail="stopped on an error"))
    f.members.append(MemberExit(7, "pool-join", 1, leaving=True))
    found = check(f)
    assert [v.invariant for v in found] == ["member-exit", "member-exit"]
    assert "#6 worker-join exited 3 on its own" in found[0].message
    assert "#7 pool-join exited 1 after SIGTERM" in found[1].message
    # SIGTERM'd while starting: its own invariant
    f.members[4:] = [MemberExit(8, "worker-join", -15, leaving=True, starting=True)]
    assert names(f) == {"member-startup-exit"}
    assert check(f, skip=frozenset({"member-startup-exit"})) == []


def global_clean() -> Facts:
    """--global-order (the clean history's stream, its replay aside): the stored records
    carry global sequences 1, 2, 4, 5, 6 (3 was stamped on a record a killed publisher never
    stored). Reader r1 hands over 1, 2, 4 and is killed having written position 2; r2
    resumes after 2 and hands over 4 again, then 5 and 6."""
    f = clean()
    f.global_stored = [
        GlobalStored(seq, gid, g) for seq, gid, g in [(1, 1, 1), (2, 2, 2), (3, 4, 4), (4, 3, 5)]
    ]
    f.global_stored.append(GlobalStored(5, 5, 6))
    f.handed = [
        Handover(row, reader, g, seq, gid)
        for row, (reader, g, seq, gid) in enumerate(
            [
                ("r1", 1, 1, 1),
                ("r1", 2, 2, 2),
                ("r1", 4, 3, 4),
                ("r2", 4, 3, 4),
                ("r2", 5, 4, 3),
                ("r2", 6, 5, 5),
            ],
            1,
        )
    ]
    f.readers = [
        ReaderRun(20, "r1", 0, -9, killed=True),
        ReaderRun(21, "r2", 2, 0, leaving=True),
    ]
    return f


def gnames(f: Facts) -> list[str]:
    return [v.invariant for v in check(f)]


def test_a_clean_global_history_with_a_restart_has_no_violation():
    assert check(global_clean()) == []


def test_a_reader_out_of_global_order_breaks_global_order():
    f = global_clean()
    f.handed[1], f.handed[2] = (  # r1: 1, 4, 2
        Handover(2, "r1", 4, 3, 4),
        Handover(3, "r1", 2, 2, 2),
    )
    found = check(f)
    assert [v.invariant for v in found] == ["global-order", "global-order"]
    assert "passing over stored records" in found[0].message
    assert "again or backwards" in found[1].message


def test_a_reader_passing_over_a_stored_record_breaks_global_order():
    f = global_clean()
    del f.handed[4]  # r2 hands over 4 then 6: gseq 5 (seq 4) passed over (and never handed)
    assert gnames(f) == ["global-order", "global-complete"]
    assert "the next stored is 5" in check(f)[0].message
    # passed over by r2 although r1 had handed it over: still out of order
    f.handed.insert(3, Handover(3, "r1", 5, 4, 3))
    f.handed[4:] = [Handover(4, "r2", 4, 3, 4), Handover(5, "r2", 6, 5, 5)]
    f.readers[1] = ReaderRun(21, "r2", 2, 0, leaving=True)
    assert gnames(f) == ["global-order"]


def test_a_restart_beyond_what_was_handed_over_breaks_global_order():
    f = global_clean()
    # r2 claims to resume after 4 (never written: r1 handed over up to 4 only... then 5)
    f.readers[1] = ReaderRun(21, "r2", 5, 0, leaving=True)
    assert "global-order" in gnames(f)
    f = global_clean()
    f.readers[1] = ReaderRun(21, "r2", 1, 0, leaving=True)  # resumes after 1, starts at 4
    assert gnames(f) == ["global-order"]
    assert "first handed over global sequence 4" in check(f)[0].message


def test_a_record_never_handed_over_breaks_global_complete():
    f = global_clean()
    f.handed = f.handed[:-1]
    assert gnames(f) == ["global-complete"]
    assert "never handed over" in check(f)[0].message


def test_a_handed_over_record_that_is_not_the_stored_one_breaks_global_complete():
    f = global_clean()
    f.handed[4] = Handover(5, "r2", 5, 4, 2)  # the stream holds gid 3 at seq 4
    assert gnames(f) == ["global-complete"]
    f = global_clean()
    f.global_stored.append(GlobalStored(6, 4, None))  # a record without a global sequence
    f.global_stored.append(GlobalStored(7, 1, 6))  # a global sequence carried twice
    found = check(f)
    assert {v.invariant for v in found} == {"global-complete"}
    assert any("no global sequence" in v.message for v in found)
    assert any("carried by 2 stored records" in v.message for v in found)


def test_a_global_drain_before_everything_was_handed_over_breaks_global_drained():
    f = global_clean()
    f.global_drains = [DrainClaim(30, high_water=3, applied_upto=3)]  # seqs 1-3: rows 1-3
    assert check(f) == []
    f.global_drains.append(DrainClaim(31, high_water=4, applied_upto=3))  # seq 4: row 5
    found = check(f)
    assert [v.invariant for v in found] == ["global-drained"]
    assert "global drain #31" in found[0].message and "seqs [4]" in found[0].message


def test_a_reader_that_exits_unbidden_breaks_global_reader_exit():
    f = global_clean()
    fenced = "error: ... position on stream EXPLORE was taken over by another reader ..."
    f.readers += [
        ReaderRun(22, "r3", 6, 3, superseded=True, tail=fenced),  # fenced: documented
        ReaderRun(23, "r4", None, 2),  # refused to start: documented
        ReaderRun(24, "r5", 6, 3, superseded=True, leaving=True, tail=fenced),
    ]
    assert check(f) == []
    f.readers.append(ReaderRun(25, "r6", 6, 3, tail="a record outside the global order"))
    f.readers.append(ReaderRun(26, "r7", None, -15, leaving=True))  # SIGTERM while starting
    f.readers.append(ReaderRun(27, "r8", 6, 3, tail=fenced))  # "fenced", but nobody newer
    found = check(f)
    assert [v.invariant for v in found] == ["global-reader-exit"] * 3
    assert "#25 global reader r6 exited 3 on its own" in found[0].message
    assert "exited -15 after SIGTERM while starting" in found[1].message
    assert "#27" in found[2].message


def test_a_repartition_left_interrupted_breaks_layout_complete():
    f = clean()
    assert check(f) == []
    f.layout_pending = "the repartition to epoch 2 is interrupted (pending switch ...)"
    found = check(f)
    assert [v.invariant for v in found] == ["layout-complete"]
    assert "epoch 2 is interrupted" in found[0].message


def test_a_refused_permission_breaks_no_permission_violation(tmp_path):
    from explore.privilege import client_denials, server_violations

    f = clean()
    log = (
        "member w-1 joined group g of EXPLORE\n"
        "error: member w-1 stopped: permission denied: publish to $KV.nor_EXPLORE_g_leases.x "
        "for the user given by --user worker (NATS_USER); the worker role needs it\n"
    )
    assert client_denials("member w-1 joined group g of EXPLORE\n") == []
    (tmp_path / "nats").mkdir()
    server_log = tmp_path / "nats" / "nats-server.log"
    server_log.write_text(
        "[1] [INF] Server is ready\n"
        '[1] [ERR] 127.0.0.1:5 - cid:9 - "v2.16.0:python3:nats-ordered" - '
        '"EXPLORE/user:worker" - Publish Violation - Subject "$KV.x.y"\n'
    )
    assert check(f) == []
    f.denials = [f"#3 worker-join (user worker): {d}" for d in client_denials(log)]
    f.denials += server_violations([server_log, tmp_path / "missing.log"])
    found = check(f)
    assert [v.invariant for v in found] == ["no-permission-violation"] * 2
    assert "#3 worker-join (user worker): error: member w-1 stopped: permission denied" in str(
        found[0]
    )
    assert found[1].message.startswith("nats: ") and "Publish Violation" in found[1].message


def test_the_least_privilege_config_gives_each_user_its_role():
    from airflow_nats_ordered.core.admin.permissions import permissions_for
    from explore.privilege import GLOBAL_USERS, OP_USERS, USERS, Accounts

    accounts = Accounts("EXPLORE", "g")
    conf = accounts.config()
    # every user's exact set, its password from the server's environment, never in the file
    for user, (role, grouped) in USERS.items():
        assert permissions_for(role, "EXPLORE", "g" if grouped else None).to_conf(user) in (
            "\n".join(line[6:] for line in conf.splitlines())
        )
    assert all(p not in conf for p in accounts.passwords.values())
    assert set(accounts.server_env()) == {f"{u.upper()}_PASSWORD" for u in [*USERS, "admin"]}
    assert accounts.client_env("worker") == {
        "NATS_USER": "worker",
        "NATS_PASSWORD": accounts.passwords["worker"],
    }
    assert set(OP_USERS.values()) == {*USERS, *GLOBAL_USERS}  # each user serves an operation
    assert OP_USERS["worker-join"] == OP_USERS["pool-join"] == "worker"
    assert OP_USERS["publish"] == OP_USERS["run"] == "publisher"
    assert not set(GLOBAL_USERS) & set(accounts.passwords)  # only with --global-order


def test_with_global_order_the_readers_and_their_watcher_get_the_readers_group():
    from airflow_nats_ordered.core.admin.permissions import permissions_for
    from explore.privilege import GLOBAL_USERS, OP_USERS, USERS, Accounts

    accounts = Accounts("EXPLORE", "g", "gg")
    conf = "\n".join(line[6:] for line in accounts.config().splitlines())
    for user, role in GLOBAL_USERS.items():
        assert permissions_for(role, "EXPLORE", "gg").to_conf(user) in conf
        assert permissions_for(role, "EXPLORE", "g").to_conf(user) not in conf
    for user, (role, grouped) in USERS.items():  # the others unchanged
        assert permissions_for(role, "EXPLORE", "g" if grouped else None).to_conf(user) in conf
    assert set(accounts.server_env()) == {
        f"{u.upper()}_PASSWORD" for u in [*USERS, *GLOBAL_USERS, "admin"]
    }
    assert OP_USERS["global-read-join"] == "reader"
    assert OP_USERS["global-drain"] == OP_USERS["final-global-drain"] == "watcher_gg"


def test_a_process_connected_as_the_admin_is_reported():
    from explore.privilege import CHECKER_NAME, wrong_users

    ok = [("nats-ordered", "worker"), ("nats-ordered p-1", "worker"), (CHECKER_NAME, "admin")]
    assert wrong_users(ok) == []
    bad = wrong_users([*ok, ("nats-ordered", "admin"), ("nats-ordered", "")])
    assert bad == [
        "a process connected as 'admin', not its role's user (connection 'nats-ordered')",
        "a process connected as 'nobody', not its role's user (connection 'nats-ordered')",
    ]


def test_every_invariant_is_shown_failing_above():
    tested = {
        "stored-once",
        "stream-key-order",
        "no-gap",
        "complete-stored",
        "sink-key-order",
        "applied-once",
        "drained-applied",
        "dead-letter-kept",
        "lag-exact",
        "counts",
        "member-exit",
        "member-startup-exit",
        "layout-complete",
        "liveness",
        "no-permission-violation",
        "global-order",
        "global-complete",
        "global-drained",
        "global-reader-exit",
    }
    assert tested == set(INVARIANTS)


def test_known_defect_names(monkeypatch):
    assert parse_skip("all") == frozenset(KNOWN_DEFECTS)  # none open now: empty
    assert parse_skip("none") == frozenset()
    monkeypatch.setitem(KNOWN_DEFECTS, "some-defect", ("what", "what skipping it turns off"))
    monkeypatch.setitem(KNOWN_DEFECTS, "other-defect", ("what", "what skipping it turns off"))
    monkeypatch.setitem(SKIPPED_INVARIANTS, "some-defect", "lag-exact")
    assert parse_skip("all") == {"some-defect", "other-defect"}
    assert parse_skip("some-defect,other-defect") == {"some-defect", "other-defect"}
    with pytest.raises(ValueError, match="unknown defect name"):
        parse_skip("some-defect,nope")


def dataclass_replace(p: PublishReport, **kw: object) -> PublishReport:
    from dataclasses import replace

    return replace(p, **kw)  # type: ignore[arg-type]


def test_a_sigterm_while_starting_is_told_from_other_exits():
    from explore.run import _sigterm_while_starting

    assert _sigterm_while_starting(-15, "")  # a worker dead by SIGTERM before any log line
    assert not _sigterm_while_starting(-15, "member w-1 joined group g of S\n")
    assert not _sigterm_while_starting(0, "")
    pool = (
        "pool: not every member left gracefully: p-1 (killed by SIGTERM), p-2 (killed by SIGTERM)\n"
    )
    assert _sigterm_while_starting(1, pool)
    assert not _sigterm_while_starting(1, pool.replace("p-2 (killed by SIGTERM)", "p-2 (exit 3)"))
