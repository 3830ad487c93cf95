"""The global-order reader's time-window mode (issue 18 part 1) for foreign producers (plain
JetStream publishes: no Nats-Global-Seq, no watermarks), on the real shared server: records
in stored-time order, and a late record under each policy.

A late record is one stored before a record the group already handed over. The test makes
one the way a crash leaves it: the group's position (key ``global``, docs/protocol.md
section 12) says a reader handed over partition 1's record ``r`` (its stored time) while
partition 0's earlier record ``x`` was still on its way; the reader resumes from it."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.global_position import POSITION_KEY
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.worker.dead_letters import HDR_ERROR, dead_letter_subject

WAIT = 60.0
GROUP = "timeline"


async def _until(cond, what: str) -> None:
    async with asyncio.timeout(WAIT):
        while not cond():
            await asyncio.sleep(0.02)


async def _foreign_records(nc, stream: str) -> tuple[int, list[int]]:
    """x on partition 0, then r on partition 1, then 12 more over both, published with a
    plain JetStream client; the group's position says r was handed over. Returns x's stream
    sequence and the on-time records' ``i`` in publish order."""
    await provision(nc, StreamSpec(stream, partitions=2))
    s = await describe(nc, stream)
    js = nc.jetstream()
    x = await js.publish(s.subject(0), b'{"i": -1}')
    r = await js.publish(s.subject(1), b'{"i": -2}')
    for i in range(12):
        await js.publish(s.subject(i % 2), json.dumps({"i": i}).encode())
    stored = await js.get_msg(stream, r.seq)
    assert stored.time is not None
    g = int(stored.time.timestamp() * 1_000_000) * 1000  # its stored time, in ns
    store = await GroupStore.open(nc, GroupConfig(stream, GROUP))
    position = {"g": g, "seqs": {"1": r.seq}, "token": 0, "order": "time"}
    await store.state.create(POSITION_KEY, json.dumps(position).encode())
    return x.seq, list(range(12))


async def _read(nc, stream: str, late: str, until) -> tuple[GlobalOrderReader, list]:
    got: list[GlobalMessage] = []
    reader = GlobalOrderReader(
        nc, stream, GROUP, got.append, order_by="time", lateness=0.2, late=late
    )
    await reader.start()
    await until(reader, got)
    await reader.stop()
    return reader, got


def _on_time(got: list[GlobalMessage]) -> list[int]:
    return [json.loads(m.data)["i"] for m in got if not m.late]


def test_flag_hands_the_late_record_over_flagged_and_the_rest_in_stored_time_order(
    nats_url, unique_name, capsys
):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            x_seq, expected = await _foreign_records(nc, unique_name)

            async def until(reader, got):
                await _until(lambda: len(got) == 13, "13 records")

            reader, got = await _read(nc, unique_name, "flag", until)
            return x_seq, expected, reader, got
        finally:
            await nc.close()

    x_seq, expected, reader, got = asyncio.run(go())
    late = [m for m in got if m.late]
    assert [(m.partition, m.stream_seq) for m in late] == [(0, x_seq)]
    assert _on_time(got) == expected  # the total order over the on-time records
    keys = [(m.global_seq, m.stream_seq) for m in got if not m.late]
    assert keys == sorted(keys)
    assert reader.stats.late == 1 and reader.error is None
    capsys.readouterr()
    args = ["status", "--stream", unique_name, "--group", GROUP, "--json", "--server", nats_url]
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_order"]["late"] == 1 and out["drained"] is True, out


def test_dead_letter_sets_the_late_record_aside(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            x_seq, expected = await _foreign_records(nc, unique_name)

            async def until(reader, got):
                await _until(lambda: len(got) == 12, "12 on-time records")

            reader, got = await _read(nc, unique_name, "dead-letter", until)
            s = await describe(nc, unique_name)
            dlq = await nc.jetstream().get_last_msg(
                f"{unique_name}_DLQ", dead_letter_subject(s.prefix, GROUP, 0)
            )
            return x_seq, expected, reader, got, dlq
        finally:
            await nc.close()

    x_seq, expected, reader, got, dlq = asyncio.run(go())
    assert _on_time(got) == expected and not any(m.late for m in got)
    assert json.loads(dlq.data) == {"i": -1}
    assert "late record" in (dlq.headers or {})[HDR_ERROR]
    assert (reader.stats.late, reader.stats.dead_lettered) == (1, 1)


def test_block_stops_the_reader_before_the_late_record(nats_url, unique_name):
    async def go():
        nc = await nats.connect(nats_url)
        try:
            await _foreign_records(nc, unique_name)

            async def until(reader, got):
                await _until(lambda: reader.error is not None, "the reader to stop")

            return await _read(nc, unique_name, "block", until)
        finally:
            await nc.close()

    reader, got = asyncio.run(go())
    assert isinstance(reader.error, NatsOrderedError)
    assert "late='block'" in str(reader.error) and "lateness" in str(reader.error)
    assert all(json.loads(m.data)["i"] >= 0 for m in got)  # x never handed over
    assert reader.stats.late == 1


def test_bad_window_settings_are_refused_by_parameter_name(nats_url):
    for kwargs, name in (
        ({"order_by": "arrival"}, "order_by"),
        ({"order_by": "time", "late": "drop"}, "late"),
        ({"order_by": "time", "lateness": 0}, "lateness"),
    ):
        with pytest.raises(ConfigError, match=name):
            GlobalOrderReader(None, "S", "g", print, **kwargs)  # type: ignore[arg-type]


def test_live_foreign_records_come_out_in_stored_time_order(nats_url, unique_name):
    """Plain publishes to 3 partitions while the reader runs (one idle): every record once,
    in publish (= stored-time) order, none late."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3))
            s = await describe(nc, unique_name)
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(
                nc, unique_name, GROUP, got.append, order_by="time", lateness=0.5
            )
            await reader.start()
            js = nc.jetstream()
            for i in range(30):
                await js.publish(s.subject(i % 2), json.dumps({"i": i}).encode())
                if i % 10 == 9:
                    await asyncio.sleep(0.3)  # bursts: partitions go idle between them
            await _until(lambda: len(got) == 30, "30 records")
            await reader.stop()
            return reader, got
        finally:
            await nc.close()

    reader, got = asyncio.run(go())
    assert _on_time(got) == list(range(30)) and reader.stats.late == 0


def test_global_read_cli_window_mode_exits_3_on_a_late_record_with_block(
    nats_url, unique_name, tmp_path, monkeypatch, capsys
):
    async def setup():
        nc = await nats.connect(nats_url)
        try:
            await _foreign_records(nc, unique_name)
        finally:
            await nc.close()

    asyncio.run(setup())
    (tmp_path / "timeline_handler.py").write_text("def apply(msg):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    base = ["global-read", "--stream", unique_name, "--group", GROUP]
    base += ["--handler", "timeline_handler:apply", "--server", nats_url]
    capsys.readouterr()
    assert cli([*base, "--lateness", "1"]) == 2  # a window knob without the window mode
    assert "--lateness applies to --order-by time" in capsys.readouterr().err
    assert cli([*base, "--order-by", "time", "--lateness", "0.2", "--late", "block"]) == 3
    err = capsys.readouterr().err
    (final,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "late record: partition 0" in final and "--late dead-letter" in final, err
    assert "late='block'" not in final  # the CLI's terms, not the Python parameter's
