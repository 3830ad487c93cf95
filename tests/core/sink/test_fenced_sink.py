"""The fenced SQLite sink: atomic judge+write+audit, fencing across real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_nats_ordered.core.sink.errors import SinkBusyError, SinkUsageError
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.sink.fencing import FenceState, Verdict
from airflow_nats_ordered.core.sink.running_totals import RunningTotals, add_to_totals

A, D, S = Verdict.APPLY, Verdict.DUPLICATE, Verdict.STALE_TOKEN
SCOPE = {"stream": "FLIGHTS", "group": "totals"}
TOTALS = RunningTotals()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "sink.db"


@pytest.fixture
def sink(db: Path):
    with FencedSqliteSink(db, **SCOPE, timeout=5) as s:
        yield s


def check_audit_invariants(sink: FencedSqliteSink, partition: int) -> list[int]:
    """The fencing guarantees, read back from the audit; returns the applied seqs in order."""
    events = sorted(
        [(r.id, "apply", r) for r in sink.audit(partition)]
        + [(f.id, "fence", f) for f in sink.fence_log(partition)],
        key=lambda e: e[0],
    )
    fence = 0
    applied: list[tuple[int, int]] = []
    for _, kind, row in events:
        if kind == "fence":
            fence = max(fence, row.token)
            assert row.highest_token == fence
        elif row.verdict is Verdict.APPLY:
            assert row.token >= fence, f"seq {row.seq} applied with token {row.token} < {fence}"
            fence = row.token  # an applied write raises the fence to its token too
            applied.append((row.token, row.seq))
        elif row.verdict is Verdict.STALE_TOKEN:
            assert row.token < fence
    assert all(a[0] <= b[0] for a, b in zip(applied, applied[1:], strict=False)), applied
    assert all(a[1] < b[1] for a, b in zip(applied, applied[1:], strict=False)), applied
    return [seq for _, seq in applied]


# -- one process ---------------------------------------------------------------------------


def test_apply_judges_applies_and_audits_in_order(sink: FencedSqliteSink) -> None:
    assert sink.state(0) == FenceState()
    sink.fence(0, 5)
    assert sink.apply(0, 4, 1) is S
    assert sink.apply(0, 5, 1) is A
    assert sink.apply(0, 5, 1) is D
    assert sink.apply(0, 6, 3) is A  # a higher token may write (and raises the fence)
    assert sink.apply(0, 5, 4) is S
    assert sink.state(0) == FenceState(highest_token=6, last_seq=3)
    rows = sink.audit()
    assert [(r.token, r.seq, r.verdict) for r in rows] == [
        (4, 1, S), (5, 1, A), (5, 1, D), (6, 3, A), (5, 4, S)
    ]  # fmt: skip
    assert {r.pid for r in rows} == {os.getpid()} and all(r.applied_at > 0 for r in rows)
    assert [(f.token, f.highest_token) for f in sink.fence_log()] == [(5, 5)]
    assert check_audit_invariants(sink, 0) == [1, 3]


def test_fn_runs_only_on_apply_inside_the_same_transaction(sink: FencedSqliteSink) -> None:
    calls: list[int] = []

    def fn(conn: sqlite3.Connection) -> None:
        assert conn.in_transaction
        calls.append(1)
        add_to_totals("N1", distance=10)(conn)

    sink.fence(0, 2)
    assert [sink.apply(0, t, s, fn) for t, s in [(2, 1), (2, 1), (1, 2), (2, 2)]] == [A, D, S, A]
    assert len(calls) == 2
    assert sink.read(TOTALS.totals) == {"N1": {"count": 2, "distance": 20}}


def test_fn_exception_rolls_back_its_writes_the_fence_state_and_the_audit(sink) -> None:
    def boom(conn: sqlite3.Connection) -> None:
        add_to_totals("N1", distance=10)(conn)
        raise RuntimeError("user code failed")

    sink.apply(0, 1, 1, add_to_totals("N1", distance=1))
    before = (sink.state(0), sink.audit(), sink.read(TOTALS.totals))
    with pytest.raises(RuntimeError, match="user code failed"):
        sink.apply(0, 1, 2, boom)
    assert (sink.state(0), sink.audit(), sink.read(TOTALS.totals)) == before
    assert sink.apply(0, 1, 2, add_to_totals("N1", distance=1)) is A  # the retry applies once
    assert sink.read(TOTALS.totals)["N1"] == {"count": 2, "distance": 2}


@pytest.mark.parametrize(
    "end",
    [lambda c: c.commit(), lambda c: c.execute("COMMIT"), lambda c: c.execute("ROLLBACK")],
)
def test_fn_cannot_end_the_transaction_so_its_writes_never_commit_alone(sink, end) -> None:
    def sneaky(conn: sqlite3.Connection) -> None:
        add_to_totals("N1", distance=10)(conn)
        end(conn)

    with pytest.raises(SinkUsageError, match="fn must only write"):
        sink.apply(0, 1, 1, sneaky)
    assert sink.state(0) == FenceState() and sink.audit() == []
    assert sink.read(TOTALS.totals) == {}
    assert sink.apply(0, 1, 1) is A  # the sink is still usable


def test_fn_may_use_savepoints_inside_the_sink_transaction(sink: FencedSqliteSink) -> None:
    def fn(conn: sqlite3.Connection) -> None:
        conn.execute("SAVEPOINT s")
        add_to_totals("N1", distance=10)(conn)
        conn.execute("RELEASE s")

    assert sink.apply(0, 1, 1, fn) is A
    assert sink.read(TOTALS.totals) == {"N1": {"count": 1, "distance": 10}}


def test_a_second_sink_on_the_same_path_sees_the_same_state(db: Path) -> None:
    with FencedSqliteSink(db, **SCOPE) as one, FencedSqliteSink(db, **SCOPE) as two:
        one.fence(3, 7)
        assert one.apply(3, 7, 10, add_to_totals("k", n=1)) is A
        assert two.state(3) == FenceState(7, 10)
        assert two.apply(3, 6, 11) is S
        assert two.apply(3, 7, 10) is D
        assert [r.verdict for r in one.audit(3)] == [A, S, D]
        assert two.read(TOTALS.totals) == {"k": {"count": 1, "n": 1}}
    with FencedSqliteSink(db, **SCOPE) as three:  # and after reopening
        assert three.state(3) == FenceState(7, 10)


def test_partitions_are_fenced_independently(sink: FencedSqliteSink) -> None:
    sink.fence(0, 9)
    assert sink.apply(1, 1, 1) is A
    assert sink.apply(0, 1, 1) is S
    assert (sink.state(0), sink.state(1)) == (FenceState(9, 0), FenceState(1, 1))
    assert [r.partition for r in sink.audit(1)] == [1]


def test_fence_never_lowers(sink: FencedSqliteSink) -> None:
    sink.fence(0, 5)
    sink.apply(0, 5, 4)
    sink.fence(0, 3)
    assert sink.state(0) == FenceState(5, 4)
    assert [(f.token, f.highest_token) for f in sink.fence_log(0)] == [(5, 5), (3, 5)]


def test_batch_is_judged_item_by_item_in_one_transaction(sink: FencedSqliteSink) -> None:
    items = [(s, add_to_totals("k", event=f"e{s}", n=s)) for s in (1, 2, 2, 5)]
    assert sink.apply_batch(0, 1, items) == [A, A, D, A]
    assert sink.state(0) == FenceState(1, 5)
    assert sink.read(TOTALS.totals) == {"k": {"count": 3, "n": 8}}
    assert [e["event"] for e in sink.read(TOTALS.events)] == ["e1", "e2", "e5"]
    sink.fence(0, 2)
    assert sink.apply_batch(0, 1, [(6, None), (7, None)]) == [S, S]
    assert sink.apply_batch(0, 2, []) == []


def test_batch_with_a_failing_fn_keeps_nothing(sink: FencedSqliteSink) -> None:
    def boom(conn: sqlite3.Connection) -> None:
        raise ValueError("bad record")

    with pytest.raises(ValueError, match="bad record"):
        sink.apply_batch(0, 1, [(1, add_to_totals("k", n=1)), (2, boom)])
    assert sink.state(0) == FenceState() and sink.audit() == []
    assert sink.read(TOTALS.totals) == {}


def test_a_busy_database_is_waited_for_until_the_other_writer_commits(db: Path) -> None:
    with FencedSqliteSink(db, **SCOPE, timeout=5) as sink:
        other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        threading.Timer(0.3, lambda: other.execute("COMMIT")).start()
        t0 = time.monotonic()
        assert sink.apply(0, 1, 1) is A
        assert time.monotonic() - t0 >= 0.25
        other.close()


def test_a_lock_held_past_the_timeout_raises_sink_busy_naming_the_fix(db: Path) -> None:
    with FencedSqliteSink(db, **SCOPE, timeout=0.2) as sink:
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(SinkBusyError, match="stayed locked .* raise timeout="):
                sink.apply(0, 1, 1)
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert sink.apply(0, 1, 1) is A  # usable again, nothing half-done


def test_locked_answers_are_retried_until_the_deadline(sink: FencedSqliteSink) -> None:
    answers = iter([sqlite3.OperationalError("database is locked")] * 3 + ["ok"])

    def op() -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert sink._retry_busy(op) == "ok"
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        sink._retry_busy(lambda: sink._connection().execute("SELECT * FROM nope"))


def test_one_sink_is_safe_to_share_between_threads(sink: FencedSqliteSink) -> None:
    def work(part: int) -> None:
        for s in range(1, 51):
            assert sink.apply(part, 1, s, add_to_totals(f"k{part}", n=1)) is A

    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sink.read(TOTALS.totals) == {f"k{p}": {"count": 50, "n": 50} for p in range(4)}


def test_pickling_reopens_the_same_file(sink: FencedSqliteSink) -> None:
    sink.fence(0, 4)
    copy = pickle.loads(pickle.dumps(sink))
    try:
        assert copy is not sink and copy.path == sink.path and copy.timeout == sink.timeout
        assert (copy.stream, copy.group, copy.remember) == (sink.stream, sink.group, sink.remember)
        assert copy.state(0) == FenceState(4, 0)
    finally:
        copy.close()


def test_misuse_is_refused_naming_the_problem(db: Path, tmp_path: Path) -> None:
    with pytest.raises(SinkUsageError, match="cannot open the sink database .*directory exists"):
        FencedSqliteSink(tmp_path / "missing" / "x.db", **SCOPE)
    with pytest.raises(ValueError, match="timeout must be"):
        FencedSqliteSink(db, **SCOPE, timeout=0)
    sink = FencedSqliteSink(db, **SCOPE)
    for call, problem in [
        (lambda: sink.apply(-1, 1, 1), "partition must be an int >= 0"),
        (lambda: sink.apply(0, -1, 1), "token must be an int >= 0"),
        (lambda: sink.apply(0, 1, 0), "seq must be an int >= 1"),
        (lambda: sink.apply(0, 1, 1, "x"), "must be callable"),  # type: ignore[arg-type]
        (lambda: sink.fence(0, "1"), "token must be an int"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ValueError, match=problem):
            call()
    assert sink.audit() == []
    sink.close()
    sink.close()
    with pytest.raises(SinkUsageError, match="is closed"):
        sink.state(0)


# -- running totals ------------------------------------------------------------------------


def test_running_totals_keep_per_key_sums_and_per_event_running_values(sink) -> None:
    flights = [
        ("N1", "f1", 100, 20.0),
        ("N2", "f2", 50, None),
        ("N1", "f3", 300, 40.5),
    ]
    for seq, (tail, fid, dist, air) in enumerate(flights, start=1):
        assert sink.apply(0, 1, seq, add_to_totals(tail, event=fid, distance=dist, air=air)) is A
    assert sink.read(TOTALS.totals) == {
        "N1": {"count": 2, "distance": 400, "air": 60.5},
        "N2": {"count": 1, "distance": 50, "air": 0},
    }
    assert sink.read(TOTALS.events) == [
        {"event": "f1", "key": "N1", "count": 1, "distance": 100, "air": 20.0},
        {"event": "f2", "key": "N2", "count": 1, "distance": 50, "air": 0},
        {"event": "f3", "key": "N1", "count": 2, "distance": 400, "air": 60.5},
    ]


def test_running_totals_add_columns_on_demand(sink: FencedSqliteSink) -> None:
    other = RunningTotals("per_route")
    sink.apply(0, 1, 1, other.add("JFK-LAX", event="a", seats=100))
    sink.apply(0, 1, 2, other.add("JFK-LAX", event="b", delay=7))
    assert sink.read(other.totals) == {"JFK-LAX": {"count": 2, "seats": 100, "delay": 7}}
    assert sink.read(other.events)[-1] == {
        "event": "b", "key": "JFK-LAX", "count": 2, "seats": 100, "delay": 7
    }  # fmt: skip
    assert sink.read(TOTALS.totals) == {}  # another table is untouched


def test_an_event_applied_twice_fails_loudly_instead_of_double_counting(sink) -> None:
    sink.apply(0, 1, 1, add_to_totals("N1", event="f1", distance=1))
    with pytest.raises(sqlite3.IntegrityError):
        sink.apply(0, 1, 2, add_to_totals("N1", event="f1", distance=1))
    assert sink.read(TOTALS.totals)["N1"]["count"] == 1 and sink.state(0).last_seq == 1


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: add_to_totals("k", **{"bad-name": 1}), "not a plain SQL identifier"),
        (lambda: add_to_totals("k", count=1), "'count' is reserved"),
        (lambda: add_to_totals("k", n=float("nan")), "not finite; pass None"),
        (lambda: add_to_totals("k", n=True), "must be an int, a float or None"),
        (lambda: add_to_totals("k", n="3"), "must be an int, a float or None"),
        (lambda: add_to_totals(7), "key must be a str"),  # type: ignore[arg-type]
        (lambda: RunningTotals("drop table"), "table name 'drop table' is not a plain"),
    ],
)
def test_running_totals_refuse_bad_input_before_touching_the_database(make, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        make()


# -- several processes -----------------------------------------------------------------------


def _old_owner(path: str, paused: Any, resume: Any, out: Any) -> None:
    sink = FencedSqliteSink(path, **SCOPE, timeout=20)
    sink.fence(0, 1)
    verdicts = [sink.apply(0, 1, s, add_to_totals("N1", event=f"f{s}", d=10)) for s in range(1, 6)]
    paused.set()  # ... the old owner stalls (GC pause, network partition) ...
    resume.wait(30)
    verdicts += [sink.apply(0, 1, s, add_to_totals("N1", event=f"f{s}", d=10)) for s in (6, 7)]
    out.put(("old", [v.name for v in verdicts]))


def _new_owner(path: str, paused: Any, resume: Any, out: Any) -> None:
    paused.wait(30)
    sink = FencedSqliteSink(path, **SCOPE, timeout=20)
    sink.fence(0, 2)  # granted the partition: fence first, then re-read from seq 1
    verdicts = [sink.apply(0, 2, s, add_to_totals("N1", event=f"f{s}", d=10)) for s in range(1, 9)]
    resume.set()
    out.put(("new", [v.name for v in verdicts]))


def _racer(path: str, token: int, fence: bool, n: int, start: Any, out: Any) -> None:
    sink = FencedSqliteSink(path, **SCOPE, timeout=20)
    start.wait(30)
    if fence:
        sink.fence(0, token)
    verdicts = []
    for s in range(1, n + 1):  # a zombie: keeps writing even after being fenced off
        verdicts.append(sink.apply(0, token, s, add_to_totals("k", event=f"e{s}", n=1)).name)
    out.put((token, verdicts))


def _collect(procs: list[Any], out: Any) -> dict[Any, list[str]]:
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return results


def test_an_old_owner_in_another_process_is_fenced_off_and_nothing_applies_twice(db) -> None:
    ctx = mp.get_context("spawn")
    paused, resume, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=f, args=(str(db), paused, resume, out)) for f in (_old_owner, _new_owner)
    ]
    for p in procs:
        p.start()
    got = _collect(procs, out)
    assert got["old"] == ["APPLY"] * 5 + ["STALE_TOKEN"] * 2
    assert got["new"] == ["DUPLICATE"] * 5 + ["APPLY"] * 3
    with FencedSqliteSink(db, **SCOPE) as sink:
        assert check_audit_invariants(sink, 0) == list(range(1, 9))
        assert sink.state(0) == FenceState(2, 8)
        assert len({r.pid for r in sink.audit()}) == 2
        assert sink.read(TOTALS.totals) == {"N1": {"count": 8, "d": 80}}
        assert [e["count"] for e in sink.read(TOTALS.events)] == list(range(1, 9))


def test_racing_processes_apply_every_seq_exactly_once_under_the_highest_fence(db) -> None:
    n, racers = 40, [(0, False), (1, True), (2, True), (3, True), (4, True)]
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(racers)), ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(str(db), tok, fence, n, start, out))
        for tok, fence in racers
    ]
    for p in procs:
        p.start()
    got = _collect(procs, out)
    for verdicts in got.values():  # once fenced off, a writer never applies again
        if "STALE_TOKEN" in verdicts:
            assert "APPLY" not in verdicts[verdicts.index("STALE_TOKEN") :]
    assert "STALE_TOKEN" not in got[4]
    with FencedSqliteSink(db, **SCOPE) as sink:
        assert check_audit_invariants(sink, 0) == list(range(1, n + 1))
        assert sink.state(0) == FenceState(4, n)
        assert len(sink.audit()) == n * len(racers)
        assert sink.read(TOTALS.totals) == {"k": {"count": n, "n": n}}
