"""The fenced sink keys its state by (stream, group, partition) and never skips silently.

Issue 7, item 8: two groups or two streams sharing one sink file must not mix tokens and
sequences, and a sequence at or below the last applied one is a DUPLICATE only when it is a
re-delivery of the message applied under it; anything else (a gap or reorder upstream, a
re-created stream) is an error. Also the token floor a worker reads before each grant.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from airflow_nats_ordered.core.sink.errors import SinkOrderError, SinkUsageError
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.sink.fencing import FenceState, Verdict
from airflow_nats_ordered.core.sink.running_totals import RunningTotals, add_to_totals
from airflow_nats_ordered.core.sink.schema import APPLIED_TABLE

A, D, S, X = Verdict.APPLY, Verdict.DUPLICATE, Verdict.STALE_TOKEN, Verdict.OUT_OF_ORDER
TOTALS = RunningTotals()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "sink.db"


def open_sink(db: Path, stream: str = "FLIGHTS", group: str = "totals", **kw) -> FencedSqliteSink:
    return FencedSqliteSink(db, stream=stream, group=group, **kw)


def test_two_groups_sharing_one_sink_file_keep_their_own_tokens_and_sequences(db) -> None:
    with open_sink(db, group="g1") as g1, open_sink(db, group="g2") as g2:
        g1.fence(0, 5)
        assert g2.apply(0, 1, 1, add_to_totals("g2", n=1)) is A  # g1's fence is not g2's
        assert g1.apply(0, 5, 1, add_to_totals("g1", n=1)) is A  # nor is g2's seq 1 g1's
        assert (g1.state(0), g2.state(0)) == (FenceState(5, 1), FenceState(1, 1))
        assert [r.verdict for r in g1.audit()] == [A] and [r.verdict for r in g2.audit()] == [A]
        assert [f.token for f in g1.fence_log()] == [5] and g2.fence_log() == []
        assert g1.read(TOTALS.totals) == {"g1": {"count": 1, "n": 1}, "g2": {"count": 1, "n": 1}}


def test_two_streams_with_the_same_group_name_keep_their_own_state(db) -> None:
    with open_sink(db, stream="A") as a, open_sink(db, stream="B") as b:
        a.apply(3, 2, 100)
        assert b.apply(3, 1, 7) is A
        assert b.apply(3, 1, 100) is A
        assert (a.state(3), b.state(3)) == (FenceState(2, 100), FenceState(1, 100))


def test_a_message_arriving_below_the_last_applied_seq_unapplied_is_an_error(db) -> None:
    ran: list[int] = []
    with open_sink(db) as sink:
        for seq in (1, 3):
            assert sink.apply(0, 1, seq, lambda c, s=seq: ran.append(s), msg_id=f"m{seq}") is A
        with pytest.raises(
            SinkOrderError, match=r"seq 2 arrived after seq 3 .* never applied"
        ) as e:
            sink.apply(0, 1, 2, lambda c: ran.append(2), msg_id="m2")  # a reorder upstream
        assert (e.value.partition, e.value.seq) == (0, 2)
        assert ran == [1, 3] and sink.state(0) == FenceState(1, 3)
        assert [(r.seq, r.verdict) for r in sink.audit()] == [(1, A), (3, A), (2, X)]


def test_a_genuine_redelivery_is_a_duplicate_with_or_without_its_msg_id(db) -> None:
    with open_sink(db) as sink:
        sink.fence(0, 1)
        for seq in (1, 3, 5):
            assert sink.apply(0, 1, seq, msg_id=f"m{seq}") is A
        assert sink.apply(0, 1, 3, msg_id="m3") is D
        assert sink.apply(0, 1, 3) is D  # no identity given: the sequence alone decides
        sink.fence(0, 2)  # a new owner re-reads the uncommitted tail
        assert sink.apply_batch(0, 2, [(3, None, "m3"), (5, None, "m5"), (6, None, "m6")]) == [
            D,
            D,
            A,
        ]


def test_another_message_under_an_applied_seq_is_refused_as_a_recreated_stream(db) -> None:
    with open_sink(db) as sink:
        sink.apply(0, 1, 1, msg_id="old-1")
        sink.apply(0, 1, 2, msg_id="old-2")
        with pytest.raises(SinkOrderError, match="applied as message 'old-1' but this is 'new-1'"):
            sink.apply(0, 1, 1, add_to_totals("k", n=1), msg_id="new-1")
        assert sink.read(TOTALS.totals) == {} and sink.state(0) == FenceState(1, 2)


def test_an_out_of_order_item_keeps_nothing_of_its_batch(db) -> None:
    with open_sink(db) as sink:
        items = [(s, add_to_totals("k", event=f"e{s}", n=1)) for s in (1, 5, 3)]
        with pytest.raises(SinkOrderError, match="seq 3 arrived after seq 5"):
            sink.apply_batch(0, 1, items)
        assert sink.state(0) == FenceState() and sink.read(TOTALS.totals) == {}
        assert [(r.seq, r.verdict) for r in sink.audit()] == [(3, X)]
        assert sink.apply_batch(0, 1, items[:2]) == [A, A]  # the in-order prefix applies later


def test_a_stale_writer_is_told_it_is_fenced_before_any_order_check(db) -> None:
    with open_sink(db) as sink:
        sink.apply(0, 1, 3)
        sink.fence(0, 2)
        assert sink.apply(0, 1, 2) is S  # never applied, but the writer is a zombie: STALE


def test_only_the_last_remember_sequences_are_kept_and_older_ones_count_as_redelivered(db):
    with open_sink(db, remember=3) as sink:
        for seq in range(10, 130, 10):  # 12 applied: pruned back to 3 once 6 are stored
            assert sink.apply(0, 1, seq) is A
        stored = sink.read(
            lambda c: [s for (s,) in c.execute(f"SELECT seq FROM {APPLIED_TABLE} ORDER BY seq")]
        )
        assert 3 <= len(stored) < 6 and stored == list(range(130 - 10 * len(stored), 130, 10))
        assert sink.apply(0, 1, 20) is D  # forgotten: taken for a re-delivery
        assert sink.apply(0, 1, stored[0]) is D  # remembered and applied
        with pytest.raises(SinkOrderError):
            sink.apply(0, 1, stored[0] + 1)  # remembered range, never applied


def test_fencing_floor_is_the_highest_token_seen_for_the_partition_in_the_scope(db) -> None:
    with open_sink(db) as sink, open_sink(db, group="other") as other:
        assert sink.fencing_floor(0) == 0
        sink.fence(0, 7)
        assert sink.fencing_floor(0) == 7
        sink.apply(0, 9, 1)  # an applied write raises the floor too
        sink.fence(0, 8)
        assert sink.fencing_floor(0) == 9
        assert sink.fencing_floor(1) == 0 and other.fencing_floor(0) == 0


def _partition_keyed_file(db: Path) -> None:
    """A sink file as the earlier version wrote it (fences keyed by partition only)."""
    with sqlite3.connect(db) as c:
        c.executescript(
            """
            CREATE TABLE nats_fence_state (partition INTEGER PRIMARY KEY,
                highest_token INTEGER NOT NULL, last_seq INTEGER NOT NULL);
            CREATE TABLE nats_fence_audit (id INTEGER PRIMARY KEY AUTOINCREMENT,
                kind TEXT NOT NULL, partition INTEGER NOT NULL, token INTEGER NOT NULL,
                seq INTEGER, verdict TEXT, highest_token INTEGER, at REAL NOT NULL,
                pid INTEGER NOT NULL);
            INSERT INTO nats_fence_state VALUES (0, 4, 10);
            INSERT INTO nats_fence_audit (kind, partition, token, highest_token, at, pid)
                VALUES ('fence', 0, 4, 4, 1.0, 1);
            INSERT INTO nats_fence_audit (kind, partition, token, seq, verdict, at, pid)
                VALUES ('apply', 0, 4, 10, 'APPLY', 2.0, 1);
            """
        )


def test_a_partition_keyed_file_is_refused_naming_the_migration(db) -> None:
    _partition_keyed_file(db)
    with pytest.raises(SinkUsageError, match=r"keyed fences by partition only.*migrate_partition"):
        open_sink(db)


def test_migrating_a_partition_keyed_file_keeps_its_fences_in_one_scope(db) -> None:
    _partition_keyed_file(db)
    assert FencedSqliteSink.migrate_partition_keyed(db, stream="FLIGHTS", group="totals") == 1
    assert FencedSqliteSink.migrate_partition_keyed(db, stream="FLIGHTS", group="totals") == 0
    with open_sink(db) as sink, open_sink(db, group="other") as other:
        assert sink.state(0) == FenceState(4, 10) and sink.fencing_floor(0) == 4
        assert [(r.seq, r.verdict) for r in sink.audit()] == [(10, A)]
        assert [f.token for f in sink.fence_log()] == [4]
        assert sink.apply(0, 3, 11) is S
        assert sink.apply(0, 4, 7) is D  # applied before the migration: not remembered
        assert sink.apply(0, 4, 11) is A
        assert other.state(0) == FenceState()


@pytest.mark.parametrize(
    "kw, problem",
    [
        ({"stream": ""}, "stream must be a non-empty str"),
        ({"group": None}, "group must be a non-empty str"),
        ({"remember": 0}, "remember must be an int >= 1"),
    ],
)
def test_a_sink_without_a_valid_scope_is_refused(db, kw, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        FencedSqliteSink(db, **{"stream": "S", "group": "g", **kw})
    with open_sink(db) as sink, pytest.raises(ValueError, match="msg_id for seq 1 must be a str"):
        sink.apply(0, 1, 1, msg_id=5)  # type: ignore[arg-type]


def test_rewind_forgets_applied_sequences_with_the_users_rows_and_keeps_the_fence(tmp_path):
    """A deliberate replay: after rewind, sequences past the kept position are applied again
    (not taken for re-deliveries), together with the user's own undo, in one transaction;
    the fence stays where it was."""
    with FencedSqliteSink(tmp_path / "s.db", stream="S", group="g") as sink:
        sink.fence(0, 7)

        def insert(seq: int):
            def fn(c):
                c.execute("CREATE TABLE IF NOT EXISTS t (seq INTEGER)")
                c.execute("INSERT INTO t VALUES (?)", (seq,))

            return fn

        for seq in (1, 2, 3, 4):
            sink.apply(0, 7, seq, insert(seq))
        sink.rewind({0: 2}, lambda c: c.execute("DELETE FROM t WHERE seq > 2"))
        assert sink.state(0).last_seq == 2 and sink.fencing_floor(0) == 7
        again = sink.apply(0, 7, 3, insert(3))
        assert again is Verdict.APPLY
        assert sink.apply(0, 7, 2) is Verdict.DUPLICATE  # still remembered as applied
        rows = sink.read(lambda c: [r[0] for r in c.execute("SELECT seq FROM t ORDER BY seq")])
    assert rows == [1, 2, 3]
