"""The global-order reader's event-time mode (issue 18 part 1): records ordered by the
producers' event time from a header (ties: stream sequence), so several producers, one of
them a foreign client (tests/js, nats.js), share one order; a late record under each
policy; a record without a usable time; a restart in the middle of a partition handed over
out of stream order. Real shared server; the header's forms are checked as plain values.

Records are published before the reader starts where the test is about order, so the
order handed over does not depend on timing: a partition not read yet holds every release
back (its frontier is 0), and a record is late only once a later one was handed over."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from datetime import UTC, datetime

import nats
import pytest
from js_client import run_node

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.order.event_time import (
    DEFAULT_TIME_HEADER,
    EventTimeError,
    parse_event_time,
)
from airflow_nats_ordered.core.order.progress import PartitionProgress
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.order.window import LateRecordError
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR, dead_letter_subject

WAIT = 60.0
GROUP = "events"
HDR = DEFAULT_TIME_HEADER

#: the fixture of tests/e2e/test_foreign_client.py: the node executable, tests/js installed


def _keys(prefix: str, partition: int, partitions: int, n: int) -> list[str]:
    """``n`` keys that route to ``partition``."""
    found = (f"{prefix}-{i}" for i in range(10_000))
    return [k for k in found if partition_for(k, partitions) == partition][:n]


def _rfc3339(ns: int) -> str:
    s, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


async def _until(cond, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not reached within {WAIT}s: {what}") from None


def _reader(nc, stream: str, handler, late: str = "block", **kw) -> GlobalOrderReader:
    kw.setdefault("lateness", 0.3)
    return GlobalOrderReader(
        nc, stream, GROUP, handler, order_by="event-time", late=late, commit_every=1, **kw
    )


def _payloads(got: list[GlobalMessage]) -> list[str]:
    return [m.data.decode() for m in got]


# -- the header's forms ------------------------------------------------------------------
def test_event_time_header_forms():
    assert parse_event_time("1795637069123") == 1795637069123 * 1_000_000
    assert parse_event_time(" 1795637069123 ") == 1795637069123 * 1_000_000
    z = parse_event_time("2026-11-25T20:04:29.123456789Z")
    assert z == 1795637069 * 1_000_000_000 + 123456789
    assert parse_event_time("2026-11-25T21:04:29.123456789+01:00") == z
    assert parse_event_time("2026-11-25t20:04:29Z") == 1795637069 * 1_000_000_000
    assert parse_event_time(_rfc3339(z)) == z
    for bad, why in (
        (None, "missing"),
        ("", "empty"),
        ("-5", "not a time"),
        ("1795637069.5", "not a time"),
        ("2026-11-25T20:04:29", "not a time"),  # no time zone: refused, not guessed
        ("2026-13-01T00:00:00Z", "not a valid date"),
        ("yesterday", "RFC 3339"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_event_time(bad)


def test_partition_progress_keeps_a_resume_point_for_out_of_order_handing():
    pr = PartitionProgress()
    for seq in (5, 7, 9):
        pr.read(seq)
    pr.done(7)
    assert (pr.prefix, pr.horizon()) == (0, 9)  # 5 is not done: resume before it
    pr.hold(9)  # late: not done, key at or below the position's
    assert pr.horizon() == 8
    pr.done(5)
    assert (pr.prefix, pr.horizon()) == (7, 8)
    pr.done(9)
    assert (pr.prefix, pr.horizon(), pr.open_records()) == (9, 9, 0)
    resumed = PartitionProgress(prefix=3, horizon=12)
    assert resumed.horizon() == 12  # not re-read yet: the old horizon stands


def test_bad_event_time_settings_are_refused_by_parameter_name():
    for kwargs, name in (
        ({"order_by": "event"}, "order_by"),
        ({"order_by": "event-time", "time_header": "Event Time"}, "time_header"),
        ({"order_by": "event-time", "time_header": ""}, "time_header"),
        ({"order_by": "time", "time_header": "Ts"}, "time_header applies to order_by='event-time'"),
    ):
        with pytest.raises(ConfigError, match=name):
            GlobalOrderReader(None, "S", "g", print, **kwargs)  # type: ignore[arg-type]


# -- several producers, one order ----------------------------------------------------------
def test_a_python_and_a_nats_js_producer_share_one_event_time_order(
    node,
    nats_url,
    unique_name,
    tmp_path,
):
    """The Python producer stamps RFC 3339 (ns) on partition 0, the nats.js one integer
    milliseconds on partition 1 (partition 2 stays idle), interleaved in event time but
    published one producer after the other; one event time is on both (the stream sequence
    breaks the tie: the Python record was stored first)."""
    base = (time.time_ns() // 1_000_000 - 60_000) * 1_000_000  # a minute ago, whole ms
    py_times = [0, 20, 40, 50, 60, 100]
    js_times = [10, 30, 50, 70, 90]
    py_keys, js_keys = _keys("py", 0, 3, len(py_times)), _keys("js", 1, 3, len(js_times))

    async def publish_python():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3))
            async with OrderedPublisher(nc, unique_name) as pub:
                for k, ms in zip(py_keys, py_times, strict=True):
                    stamp = _rfc3339(base + ms * 1_000_000)
                    await pub.publish(k, f"py@{ms}".encode(), headers={HDR: stamp})
        finally:
            await nc.close()

    asyncio.run(publish_python())
    spec = {
        "header": HDR,
        "records": [
            {"key": k, "payload": f"js@{ms}", "time": base // 1_000_000 + ms}
            for k, ms in zip(js_keys, js_times, strict=True)
        ],
    }
    (tmp_path / "records.json").write_text(json.dumps(spec))
    records = str(tmp_path / "records.json")
    out = run_node(node, "event_time_producer.mjs", nats_url, unique_name, "js-1", records)
    assert json.loads(out)["published"] == len(js_times)

    async def read():
        nc = await nats.connect(nats_url)
        try:
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got.append)
            await reader.start()
            await _until(lambda: len(got) == 11 or reader.error is not None, "11 records")
            await reader.stop()
            return reader, got
        finally:
            await nc.close()

    reader, got = asyncio.run(read())
    assert reader.error is None and reader.stats.late == 0
    assert _payloads(got) == [
        "py@0", "js@10", "py@20", "js@30", "py@40", "py@50", "js@50",
        "py@60", "js@70", "js@90", "py@100",
    ]  # fmt: skip
    assert [m.global_seq for m in got] == sorted(base + int(p.split("@")[1]) * 1_000_000
                                                 for p in _payloads(got))  # fmt: skip
    assert {m.partition for m in got if m.data.startswith(b"py")} == {0}
    assert {m.partition for m in got if m.data.startswith(b"js")} == {1}


def test_live_producers_with_a_lagging_clock_come_out_in_event_time_order(nats_url, unique_name):
    """While the reader runs, two producers publish in turns on two partitions: one stamps
    its records 300 ms in the past (a clock behind, well inside the 5 s lateness), so the
    stored order differs from the event-time order; every record comes out once, in
    event-time order, none late."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            (k0,), (k1,) = _keys("p", 0, 2, 1), _keys("q", 1, 2, 1)
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got.append, lateness=5.0)
            await reader.start()
            stamps = []
            async with (
                OrderedPublisher(nc, unique_name, producer_id="prompt") as prompt,
                OrderedPublisher(nc, unique_name, producer_id="lagging") as lagging,
            ):
                for _ in range(10):
                    for pub, key, skew in ((prompt, k0, 0), (lagging, k1, 300_000_000)):
                        t = time.time_ns() - skew
                        stamps.append(t)
                        await pub.publish(key, b"%d" % t, headers={HDR: _rfc3339(t)})
                        await pub.flush()  # stored now: the stored order is the turns'
                    await asyncio.sleep(0.05)  # pacing: the reader catches up between turns
            await _until(lambda: len(got) == 20 or reader.error is not None, "20 records")
            await reader.stop()
            return reader, got, stamps
        finally:
            await nc.close()

    reader, got, stamps = asyncio.run(go())
    assert reader.error is None and reader.stats.late == 0
    assert [int(m.data) for m in got] == sorted(stamps)
    assert [m.global_seq for m in got] == sorted(stamps)


# -- late records -------------------------------------------------------------------------
@pytest.mark.parametrize("late", ["flag", "dead-letter", "block"])
def test_a_late_record_under_each_policy(nats_url, unique_name, late, capsys):
    """A is handed over, then B arrives with an event time 30 s before A's (a producer
    whose clock or delivery lags by more than the lateness), then C (on time)."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            (ka,), (kb, kc) = _keys("a", 0, 2, 1), _keys("b", 1, 2, 2)
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got.append, late=late)
            await reader.start()
            now = time.time_ns()
            async with OrderedPublisher(nc, unique_name) as pub:
                await pub.publish(ka, b"A", headers={HDR: _rfc3339(now)})
                await pub.flush()
                await _until(lambda: len(got) == 1, "A handed over")
                await pub.publish(kb, b"B", headers={HDR: _rfc3339(now - 30 * 10**9)})
                await pub.publish(kc, b"C", headers={HDR: str(time.time_ns() // 10**6 + 1)})
            if late == "block":
                await _until(lambda: reader.error is not None, "the reader to stop")
            else:
                await _until(lambda: len(got) == 2 + (late == "flag"), "B and C")
            await reader.stop()
            dlq = None
            if late == "dead-letter":
                s = await describe(nc, unique_name)
                dlq = await nc.jetstream().get_last_msg(
                    f"{unique_name}_DLQ", dead_letter_subject(s.prefix, GROUP, 1)
                )
            return reader, got, dlq
        finally:
            await nc.close()

    reader, got, dlq = asyncio.run(go())
    assert reader.stats.late == 1
    if late == "flag":
        assert [(m.data, m.late) for m in got] == [(b"A", False), (b"B", True), (b"C", False)]
    elif late == "dead-letter":
        assert _payloads(got) == ["A", "C"] and reader.error is None
        assert dlq.data == b"B" and "with an event time 30.0" in dlq.headers[HDR_ERROR]
    else:
        assert _payloads(got) == ["A"]  # stopped before B, so C waits behind it
        assert isinstance(reader.error, LateRecordError) and reader.error.partition == 1
        assert "late='block'" in str(reader.error) and "lateness 0.3s" in str(reader.error)
    capsys.readouterr()
    args = ["status", "--stream", unique_name, "--group", GROUP, "--json", "--server", nats_url]
    assert cli(args) == 0
    glob = json.loads(capsys.readouterr().out)["global_order"]
    assert glob["late"] == 1 and glob["order"] == "event-time", glob
    # the position is an event time: also shown as one (RFC 3339), not as a bare ns count
    when = dt.datetime.fromisoformat(glob["position_time"].replace("Z", "+00:00"))
    assert abs(when.timestamp() - glob["position"] / 1e9) < 1e-3, glob
    assert glob["held_back_by"] == [], glob
    if late == "block":  # status says why the reader stopped
        assert glob["error"].startswith("LateRecordError: late record: partition 1"), glob
    else:
        assert glob["error"] is None, glob


# -- records without a usable time ----------------------------------------------------------
async def _untimed_records(nc, stream: str) -> tuple[int, int]:
    """A and D on partition 0 with times; on partition 1 one record without the header and
    one with a value that is no time. Returns the two bad records' stream sequences."""
    await provision(nc, StreamSpec(stream, partitions=2))
    (ka, kd), (kb, kc) = _keys("a", 0, 2, 2), _keys("b", 1, 2, 2)
    base = time.time_ns() - 60 * 10**9
    async with OrderedPublisher(nc, stream) as pub:
        await pub.publish(ka, b"A", headers={HDR: _rfc3339(base)})
        await pub.publish(kb, b"no-header")
        await pub.flush()
        await pub.publish(kc, b"bad-header", headers={HDR: "yesterday"})
        await pub.publish(kd, b"D", headers={HDR: _rfc3339(base + 10**6)})
    stored = [await nc.jetstream().get_msg(stream, seq) for seq in range(1, 5)]
    seqs = {m.data: m.seq for m in stored}
    return seqs[b"no-header"], seqs[b"bad-header"]


def test_records_without_a_usable_time_are_set_aside_with_dead_letter(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            missing, bad = await _untimed_records(nc, unique_name)
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got.append, late="dead-letter")
            await reader.start()
            await _until(lambda: len(got) == 2 and reader.stats.untimed == 2, "A, D, 2 set aside")
            await reader.stop()
            dlq = f"{unique_name}_DLQ"
            first, second = [await nc.jetstream().get_msg(dlq, seq) for seq in (1, 2)]
            s = await describe(nc, unique_name)
            assert first.subject == second.subject == dead_letter_subject(s.prefix, GROUP, 1)
            return reader, got, missing, bad, first, second
        finally:
            await nc.close()

    reader, got, missing, bad, first, second = asyncio.run(go())
    assert _payloads(got) == ["A", "D"] and reader.error is None
    assert (first.data, second.data) == (b"no-header", b"bad-header")
    e1, e2 = first.headers[HDR_ERROR], second.headers[HDR_ERROR]
    assert f"header {HDR} of partition 1, stream sequence {missing}: the header is missing" in e1
    assert f"stream sequence {bad}: 'yesterday' is not a time" in e2
    assert reader.stats.late == 0 and reader.stats.dead_lettered == 2


def test_a_record_without_a_time_stops_the_reader_otherwise_in_each_interfaces_terms(
    nats_url, unique_name, tmp_path, monkeypatch, capsys
):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            missing, _ = await _untimed_records(nc, unique_name)
            got: list[GlobalMessage] = []
            reader = _reader(nc, unique_name, got.append, late="flag")
            await reader.start()
            await _until(lambda: reader.error is not None, "the reader to stop")
            await reader.stop()
            return reader, got, missing
        finally:
            await nc.close()

    reader, got, missing = asyncio.run(go())
    err = reader.error
    assert isinstance(err, EventTimeError) and (err.partition, err.seq) == (1, missing)
    assert f"header {HDR} of partition 1, stream sequence {missing}" in str(err)
    assert "time_header" in str(err) and "late='dead-letter'" in str(err)
    assert "no-header" not in _payloads(got)

    (tmp_path / "events_handler.py").write_text("def apply(msg):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    base = ["global-read", "--stream", unique_name, "--group", "cli-events"]
    base += ["--handler", "events_handler:apply", "--server", nats_url]
    capsys.readouterr()
    assert cli([*base, "--time-header", "Ts"]) == 2  # needs --order-by event-time
    assert "--time-header applies to --order-by event-time" in capsys.readouterr().err
    assert cli([*base, "--order-by", "event-time", "--lateness", "0.3"]) == 3
    (final,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert f"header {HDR} of partition 1, stream sequence {missing}" in final, final
    assert "--time-header" in final and "--late dead-letter" in final, final
    assert "time_header" not in final and "late='" not in final  # the CLI's terms
    # and so does `status`, which shows why that reader stopped
    status = ["status", "--stream", unique_name, "--group", "cli-events", "--json"]
    assert cli([*status, "--server", nats_url]) == 0
    error = json.loads(capsys.readouterr().out)["global_order"]["error"]
    assert error.startswith("EventTimeError: no event time: header") and "--time-header" in error
    assert "time_header" not in error and "late='" not in error, error


# -- resuming -----------------------------------------------------------------------------
def test_a_restart_resumes_a_partition_handed_over_out_of_stream_order(nats_url, unique_name):
    """One partition stores r30, r10, r20, r40 (event times): handed over r10, r20, then
    the handler fails on r30. Started again, the reader hands over r30 and r40, nothing
    twice: the position is not "the last record handed over" (r20's stream sequence, which
    would skip r30 for good)."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=1))
            base = time.time_ns() - 60 * 10**9
            async with OrderedPublisher(nc, unique_name) as pub:
                for ms in (30, 10, 20, 40):
                    stamp = {HDR: _rfc3339(base + ms * 10**6)}
                    await pub.publish(f"k{ms}", f"r{ms}".encode(), headers=stamp)
            got: list[str] = []

            def failing(msg: GlobalMessage) -> None:
                if msg.data == b"r30":
                    raise RuntimeError("the ledger is down")
                got.append(msg.data.decode())

            reader = _reader(nc, unique_name, failing)
            await reader.start()
            await _until(lambda: reader.error is not None, "the handler to fail on r30")
            await reader.stop()
            first = list(got)
            got.clear()
            again = _reader(nc, unique_name, lambda m: got.append(m.data.decode()))
            await again.start()
            # a record handed over twice would come first (r10 and r20 have the smaller keys)
            await _until(lambda: len(got) >= 2, "r30 and r40")
            await again.stop()
            return first, got, again
        finally:
            await nc.close()

    first, second, again = asyncio.run(go())
    assert first == ["r10", "r20"]
    assert second == ["r30", "r40"] and again.error is None
