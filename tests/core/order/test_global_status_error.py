"""`status` shows why a global-order reader stopped on its own (issue 18 part 1): the reader
writes the error into its position (key ``global`` of the group's state bucket) when it
stops, `status` (table and --json) and `group list` show it as a problem until a reader of
the group starts again. Real shared server."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.order.merge import GlobalOrderViolation
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision

WAIT = 60.0
GROUP = "ledger"


async def _until(cond, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not reached within {WAIT}s: {what}") from None


def _status(url: str, stream: str, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(["status", "--stream", stream, "--group", GROUP, *extra, "--server", url])
    return code, capsys.readouterr().out


def test_status_shows_the_violation_that_stopped_a_global_reader(nats_url, unique_name, capsys):
    """5 stamped records, then one a plain JetStream client published (no Nats-Global-Seq):
    the reader stops before it (when it reads it: maybe before handing the 5 over)."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                for i in range(5):
                    await pub.publish(f"k{i}", b"%d" % i)
            s = await describe(nc, unique_name)
            await nc.jetstream().publish(s.subject(0), b"foreign")
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(nc, unique_name, GROUP, got.append, member_id="r1")
            await reader.start()
            await _until(lambda: reader.error is not None, "the reader to stop")
            await reader.stop()
            return reader, got
        finally:
            await nc.close()

    reader, got = asyncio.run(go())
    assert isinstance(reader.error, GlobalOrderViolation) and len(got) <= 5
    code, out = _status(nats_url, unique_name, capsys, "--json")
    assert code == 0
    status = json.loads(out)
    glob = status["global_order"]
    assert glob["reader"] is None and glob["member"] == "r1"
    assert glob["error"].startswith("GlobalOrderViolation: partition 0:"), glob
    assert "no Nats-Global-Seq header" in glob["error"]
    (problem,) = [p for p in status["problems"] if "global-order reader" in p]
    assert problem.startswith("global-order reader r1 stopped: GlobalOrderViolation"), problem
    assert f"nats-ordered global-read --stream {unique_name} --group {GROUP}" in problem
    code, table = _status(nats_url, unique_name, capsys)
    assert "the last one stopped on an error (see problems)" in table, table
    assert "problems:" in table and "global-order reader r1 stopped: GlobalOrderViolation" in table
    capsys.readouterr()
    assert cli(["group", "list", "--stream", unique_name, "--json", "--server", nats_url]) == 0
    (summary,) = json.loads(capsys.readouterr().out)["groups"]
    assert any("global-order reader r1 stopped" in p for p in summary["problems"]), summary


def test_a_handler_failure_shows_until_a_reader_starts_again(nats_url, unique_name, capsys):
    """The handler raises on the 3rd record: status names it; a reader started again (with
    a handler that works) clears it, running and after a stop by request."""

    async def publish():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            async with OrderedPublisher(nc, unique_name, global_order=GlobalOrder()) as pub:
                for i in range(6):
                    await pub.publish(f"k{i}", b"%d" % i)
        finally:
            await nc.close()

    async def read(fail_on: bytes | None, stop_when) -> GlobalOrderReader:
        nc = await nats.connect(nats_url)
        try:
            got: list[GlobalMessage] = []

            def handle(msg: GlobalMessage) -> None:
                if msg.data == fail_on:
                    raise ValueError("account 2 is locked")
                got.append(msg)

            reader = GlobalOrderReader(nc, unique_name, GROUP, handle, member_id="r2")
            await reader.start()
            await _until(lambda: stop_when(reader, got), "the reader's work")
            if reader.error is None:  # while it runs: once its heartbeat shows, no error
                loop = asyncio.get_running_loop()
                while True:
                    out = await loop.run_in_executor(
                        None, lambda: _status(nats_url, unique_name, capsys, "--json")[1]
                    )
                    running = json.loads(out)
                    if running["global_order"]["reader"] or reader.error is not None:
                        break
                reader.running_status = running  # type: ignore[attr-defined]
            await reader.stop()
            return reader
        finally:
            await nc.close()

    asyncio.run(publish())
    failed = asyncio.run(read(b"2", lambda r, got: r.error is not None))
    assert "the handler raised" in str(failed.error) and failed.stats.handled == 2
    status = json.loads(_status(nats_url, unique_name, capsys, "--json")[1])
    error = status["global_order"]["error"]
    assert "ValueError('account 2 is locked')" in error and "stream sequence" in error, error
    assert any("account 2 is locked" in p for p in status["problems"]), status["problems"]

    again = asyncio.run(read(None, lambda r, got: len(got) == 4 or r.error is not None))
    assert again.error is None and again.stats.handled == 4
    running = again.running_status  # type: ignore[attr-defined]
    assert running["global_order"]["reader"] == "r2" and running["global_order"]["error"] is None
    assert not any("global-order reader" in p for p in running["problems"]), running
    status = json.loads(_status(nats_url, unique_name, capsys, "--json")[1])
    assert status["global_order"]["error"] is None and status["drained"] is True, status
    assert not any("global-order reader" in p for p in status["problems"]), status["problems"]
