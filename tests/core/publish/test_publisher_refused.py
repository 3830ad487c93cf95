"""A publisher the server refuses for good (issue 28 item 2) ends, reports what it did not
store and leaves the CPU alone; the run it was publishing is recorded ``partial`` and a
re-run of the same input completes it, each record stored once.

The refusals are the server's own, on a real nats-server: a repartition while records are
still being fed (the old layout's subjects have no stream any more), a deleted stream and
a record the stream refuses. Before the fix a lane refused while committing its batch kept
``broken`` without a batch and returned from every step without suspending: the program
spun at 100% CPU and ``flush``/``close`` never returned, so each scenario runs in a child
process under a deadline (a spinning event loop cannot time itself out).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict

import nats
from locations import TESTS
from nats.js import api
from streamcheck import read_stream

from airflow_nats_ordered.core.publish.runs import RunLedger, publish_run
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.inputs.records import InputRecord

#: seconds a child may take: generous (a loaded 2-core machine), and far below "for ever"
DEADLINE = 120
#: the CPU a refused, open publisher may use while it sits for ``IDLE`` seconds: a spinning
#: loop uses all of them, an idle one next to none (this is not a speed: it is CPU time)
IDLE, CPU_BOUND = 3.0, 0.3

_CHILD_PRELUDE = r"""
import asyncio, json, sys, time
import nats
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher, PublishError

URL, STREAM, IDLE = sys.argv[1], sys.argv[2], float(sys.argv[4])


async def stored_count(nc, n):
    # until the stream holds n messages (the batches stay open: linger 30 s)
    js = nc.jetstream()
    deadline = time.monotonic() + 60
    while (await js.stream_info(STREAM)).state.messages < n:
        assert time.monotonic() < deadline, "the records were not stored within 60 s"
        await asyncio.sleep(0.05)


async def refused_and_idle(pub, late):
    # publish the late records, flush (refused), then sit refused and open for IDLE seconds
    for k in late:
        await pub.publish(k, b"late")
    try:
        await pub.flush()
        error = None
    except PublishError as exc:
        error = str(exc)
    cpu0 = time.process_time()
    await asyncio.sleep(IDLE)
    cpu = time.process_time() - cpu0
    summary = await pub.close(raise_on_failure=False)
    return {
        "error": error,
        "cpu": cpu,
        "accepted": summary.accepted,
        "acked": summary.acked,
        "failed": summary.failed,
        "stored": sum(p.stored or 0 for p in summary.partitions),
        "errors": [p.error for p in summary.partitions],
    }
"""

_REPARTITIONED = (
    _CHILD_PRELUDE
    + r"""
from airflow_nats_ordered.core.stream.repartition import repartition


async def main():
    nc = await nats.connect(URL)
    pub = OrderedPublisher(nc, STREAM, linger=30.0)
    await pub.start()
    keys = [f"k{i}" for i in range(12)]  # every partition of 4 has some
    for i, k in enumerate(keys * 4):
        await pub.publish(k, b"%d" % i)
    await stored_count(nc, 48)
    await repartition(nc, STREAM, 8)  # every lane's batch is open on the old layout
    # partitions 0 and 1 are refused sending more, 2 and 3 when the flush commits them
    late = [k for k in keys if partition_for(k, 4) in (0, 1)]
    print(json.dumps(await refused_and_idle(pub, late)), flush=True)
    await nc.close()


asyncio.run(main())
"""
)

_DELETED = (
    _CHILD_PRELUDE
    + r"""
async def main():
    nc = await nats.connect(URL)
    pub = OrderedPublisher(nc, STREAM, linger=30.0)
    await pub.start()
    keys = [f"k{i}" for i in range(12)]
    for i, k in enumerate(keys):
        await pub.publish(k, b"%d" % i)
    await stored_count(nc, 12)
    await nc.jetstream().delete_stream(STREAM)
    print(json.dumps(await refused_and_idle(pub, keys[:3])), flush=True)
    await nc.close()


asyncio.run(main())
"""
)

_REFUSED_RECORD = (
    _CHILD_PRELUDE
    + r"""
async def main():
    nc = await nats.connect(URL)
    # the stream takes 5 messages per subject (discard new): the 6th is refused, for as long
    # as the publisher retries (the limit may lift), at most delivery_timeout
    pub = OrderedPublisher(nc, STREAM, linger=30.0, delivery_timeout=2.0)
    await pub.start()
    k = "k2"  # partition 0 of 4
    for i in range(5):
        await pub.publish(k, b"%d" % i)
    await stored_count(nc, 5)
    print(json.dumps(await refused_and_idle(pub, [k, k, k])), flush=True)
    await nc.close()


asyncio.run(main())
"""
)

_REFUSED_FOR_GOOD = (
    _CHILD_PRELUDE
    + r"""
async def main():
    nc = await nats.connect(URL)
    pub = OrderedPublisher(nc, STREAM, linger=30.0)
    await pub.start()
    k = "k2"  # partition 0 of 4
    for i in range(5):
        await pub.publish(k, b"%d" % i)
    await stored_count(nc, 5)
    # a record the server refuses for good (it expects another stream), then two more
    await pub.publish(k, b"bad", headers={"Nats-Expected-Stream": "NOT-THIS-ONE"})
    print(json.dumps(await refused_and_idle(pub, [k, k])), flush=True)
    await nc.close()


asyncio.run(main())
"""
)


def _run_child(script: str, url: str, stream: str) -> dict:
    """Run ``script`` (the publisher's side) in a child under :data:`DEADLINE`; its report."""
    args = [sys.executable, "-c", script, url, stream, str(TESTS), str(IDLE)]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=DEADLINE)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-1500:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise AssertionError(
            f"the refused publisher did not end within {DEADLINE} s (flush/close hung); "
            f"its log ended: {tail}"
        ) from None
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _provision(url: str, stream: str, partitions: int = 4, per_subject: int = 0) -> None:
    async def go() -> None:
        nc = await nats.connect(url)
        try:
            await provision(nc, StreamSpec(stream, partitions=partitions, storage="memory"))
            if per_subject:
                js = nc.jetstream()
                cfg = (await js.stream_info(stream)).config
                cfg.max_msgs_per_subject = per_subject
                cfg.discard = api.DiscardPolicy.NEW
                cfg.discard_new_per_subject = True
                await js.update_stream(cfg)
        finally:
            await nc.close()

    asyncio.run(go())


def test_a_publisher_refused_by_a_repartition_ends_idle_and_reports_what_it_did_not_store(
    shared_nats_server, unique_name
):
    _provision(shared_nats_server.url, unique_name)
    got = _run_child(_REPARTITIONED, shared_nats_server.url, unique_name)
    late = sum(1 for i in range(12) if partition_for(f"k{i}", 4) in (0, 1))
    assert got["accepted"] == 48 + late
    # every record is accounted for: acknowledged or reported; the 48 fed before the switch
    # are stored (those whose batch could not be committed are reported, not confirmed)
    assert got["acked"] + got["failed"] == got["accepted"] and got["failed"] >= late
    assert got["stored"] == 48
    assert got["error"] and "was repartitioned to 8 partitions (epoch 1)" in got["error"]
    assert all("repartitioned" in (e or "") for e in got["errors"]), got["errors"]
    assert got["cpu"] < CPU_BOUND, f"the refused publisher used {got['cpu']:.2f}s of CPU"


def test_a_publisher_whose_stream_was_deleted_ends_idle_and_reports_what_it_did_not_store(
    shared_nats_server, unique_name
):
    _provision(shared_nats_server.url, unique_name)
    got = _run_child(_DELETED, shared_nats_server.url, unique_name)
    assert got["accepted"] == 15 and got["acked"] + got["failed"] == 15
    assert got["failed"] >= 3
    assert got["error"] and "no longer exists" in got["error"], got["error"]
    assert got["cpu"] < CPU_BOUND, f"the refused publisher used {got['cpu']:.2f}s of CPU"


def test_a_publisher_over_a_stream_limit_ends_idle_after_its_delivery_timeout(
    shared_nats_server, unique_name
):
    _provision(shared_nats_server.url, unique_name, per_subject=5)
    got = _run_child(_REFUSED_RECORD, shared_nats_server.url, unique_name)
    assert got["accepted"] == 8 and got["acked"] + got["failed"] == 8
    assert got["stored"] == 5 and got["failed"] >= 3
    assert got["error"] and "maximum messages per subject exceeded" in got["error"]
    assert got["cpu"] < CPU_BOUND, f"the refused publisher used {got['cpu']:.2f}s of CPU"


def test_a_publisher_refused_a_record_for_good_ends_idle_and_reports_the_rest(
    shared_nats_server, unique_name
):
    _provision(shared_nats_server.url, unique_name)
    got = _run_child(_REFUSED_FOR_GOOD, shared_nats_server.url, unique_name)
    assert got["accepted"] == 8 and got["acked"] + got["failed"] == 8
    assert got["stored"] == 5 and got["failed"] == 3
    assert got["error"] and "expected stream does not match" in got["error"], got["error"]
    assert got["cpu"] < CPU_BOUND, f"the refused publisher used {got['cpu']:.2f}s of CPU"


# -- the run: publish_run fed by an async generator while the stream is repartitioned --------

#: the input: 60 records over 12 keys (every partition of 4), then 60 of the keys of old
#: partitions 0 and 1 only, so that 2 and 3 are refused when their batch is committed
_KEYS = [f"k{i}" for i in range(12)]
_LATE_KEYS = [k for k in _KEYS if partition_for(k, 4) in (0, 1)]
_ROWS = [(_KEYS[i % 12], i) for i in range(60)] + [
    (_LATE_KEYS[i % len(_LATE_KEYS)], 60 + i) for i in range(60)
]
SWITCH_AT = 60

_RUN = r"""
import asyncio, json, sys, time
import nats
from airflow_nats_ordered.core.publish.publisher import PublisherConfig
from airflow_nats_ordered.core.stream.repartition import repartition
from airflow_nats_ordered.core.publish.runs import publish_run
from airflow_nats_ordered.inputs.records import InputRecord

URL, STREAM, ROWS, SWITCH_AT = sys.argv[1], sys.argv[2], json.loads(sys.argv[4]), 60


async def main():
    nc = await nats.connect(URL)
    js = nc.jetstream()

    async def feed():
        for n, (k, i) in enumerate(ROWS):
            if n == SWITCH_AT:  # what was fed is stored, every batch open: switch
                deadline = time.monotonic() + 60
                while (await js.stream_info(STREAM)).state.messages < SWITCH_AT:
                    assert time.monotonic() < deadline, "not stored within 60 s"
                    await asyncio.sleep(0.05)
                await repartition(nc, STREAM, 8)
            yield InputRecord(k, json.dumps({"k": k, "i": i}).encode(), None, f"row {n}")
            await asyncio.sleep(0.002)

    result = await publish_run(
        nc, STREAM, feed(), producer_id="run-1", config=PublisherConfig(linger=30.0)
    )
    r = result.record
    print(json.dumps({"status": r.status, "error": r.error, "accepted": r.accepted,
                      "acked": r.acked, "failed": r.failed, "epoch": r.epoch}), flush=True)
    await nc.close()


asyncio.run(main())
"""


def test_a_run_refused_by_a_repartition_mid_feed_is_recorded_partial_and_a_rerun_completes_it(
    shared_nats_server, unique_name
):
    """publish_run reads an async generator; the stream is repartitioned while it feeds.
    The attempt ends (under a deadline) with the run ``partial`` and the refusal as its
    error; the same input published again as the same run completes it, every record
    stored exactly once across the two layouts, each key's records in input order."""
    url = shared_nats_server.url
    _provision(url, unique_name)
    args = [sys.executable, "-c", _RUN, url, unique_name, "-", json.dumps(_ROWS)]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=DEADLINE)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-1500:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise AssertionError(
            f"publish_run did not end within {DEADLINE} s after the repartition; its log "
            f"ended: {tail}"
        ) from None
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["status"] == "partial" and first["epoch"] == 0, first
    assert "was repartitioned to 8 partitions (epoch 1)" in (first["error"] or ""), first
    assert first["accepted"] == len(_ROWS) and first["failed"] >= len(_ROWS) - SWITCH_AT

    async def rerun():
        nc = await nats.connect(url)
        try:
            records = [
                InputRecord(k, json.dumps({"k": k, "i": i}).encode(), None, f"row {n}")
                for n, (k, i) in enumerate(_ROWS)
            ]
            result = await asyncio.wait_for(
                publish_run(nc, unique_name, records, producer_id="run-1"), DEADLINE
            )
            again = await asyncio.wait_for(
                publish_run(nc, unique_name, records, producer_id="run-1"), DEADLINE
            )
            ledger = await (await RunLedger.open(nc, unique_name)).get("run-1")
            return result, again, ledger, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    result, again, ledger, stored = asyncio.run(rerun())
    assert result.record.status == "complete" and result.record.epoch == 1, result.record
    assert result.record.before_switch["epoch"] == 0
    assert again.skipped and ledger is not None and ledger.status == "complete"
    # exactly once across the layouts (the ledger's carry-over passes over what the old
    # layout stored; it does not rely on the msg-id), each key in input order
    per_key: dict[str, list[int]] = defaultdict(list)
    for m in stored:
        per_key[m.key].append(json.loads(m.data)["i"])
    want: dict[str, list[int]] = defaultdict(list)
    for k, i in _ROWS:
        want[k].append(i)
    assert len(stored) == len(_ROWS), f"{len(stored)} stored of {len(_ROWS)} records"
    assert dict(per_key) == dict(want)
