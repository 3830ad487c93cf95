"""The run ledger: a complete run is never published again, a partial one resumes exactly,
even far past the stream's duplicate window (real nats-server)."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from streamcheck import read_stream

from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.runs import RunLedger, publish_run
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.inputs.files import records_from_rows

#: a publisher whose resends end within a 2 s duplicate window, so a test can outwait it
QUICK = PublisherConfig(ack_timeout=0.3, delivery_timeout=0.6)


def _rows(n: int, keys: int = 13) -> list[dict]:
    # repeated payloads on purpose: identical records at different positions are distinct
    return [{"k": f"key{i % keys}", "op": "incr", "i": i // 50} for i in range(n)]


class Interrupted(Exception):
    pass


def _failing_after(rows: list[dict], n: int):
    """The records, then a crash of the reading job after ``n`` of them."""
    for i, rec in enumerate(records_from_rows(rows, key_field="k")):
        if i == n:
            raise Interrupted(f"input lost after {n} records")
        yield rec


async def _per_key(nc, stream: str) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for s in await read_stream(nc, stream):
        out.setdefault(s.key, []).append(s.data)
    return out


def test_a_complete_run_is_never_published_again_even_past_the_duplicate_window(
    nats_url, unique_name
):
    rows = _rows(300)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4, duplicate_window=2))
        first = await publish_run(
            nc,
            unique_name,
            records_from_rows(rows, key_field="k"),
            producer_id="r1",
            config=QUICK,
        )
        await asyncio.sleep(2.5)  # the server has forgotten every msg-id
        again = await publish_run(
            nc,
            unique_name,
            records_from_rows(rows, key_field="k"),
            producer_id="r1",
            config=QUICK,
        )
        stored = (await nc.jetstream().stream_info(unique_name)).state.messages
        await nc.close()
        return first, again, stored

    first, again, stored = asyncio.run(go())
    assert not first.skipped and first.record.status == "complete" and first.record.acked == 300
    assert again.skipped and again.record.attempts == 1
    assert stored == 300
    assert again.to_dict()["high_water_marks"] == first.to_dict()["high_water_marks"]


def test_a_partial_run_resumes_exactly_past_the_duplicate_window(nats_url, unique_name):
    rows = _rows(500)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=4, duplicate_window=2))
        with pytest.raises(Interrupted):
            await publish_run(
                nc, unique_name, _failing_after(rows, 222), producer_id="r2", config=QUICK
            )
        partial = await (await RunLedger.open(nc, unique_name)).get("r2")
        await asyncio.sleep(2.5)  # past the window: only the ledger prevents duplicates
        resumed = await publish_run(
            nc,
            unique_name,
            records_from_rows(rows, key_field="k"),
            producer_id="r2",
            config=QUICK,
        )
        per_key = await _per_key(nc, unique_name)
        await nc.close()
        return partial, resumed, per_key

    partial, resumed, per_key = asyncio.run(go())
    assert partial.status == "partial" and partial.acked == 222
    assert "input lost after 222" in (partial.error or "")
    assert resumed.record.status == "complete" and resumed.record.attempts == 2
    assert resumed.record.skipped == 222 and resumed.record.acked == 500
    expected: dict[str, list[bytes]] = {}
    for r in rows:
        expected.setdefault(r["k"], []).append(json.dumps(r, separators=(",", ":")).encode())
    assert per_key == expected, "a record is missing, duplicated or out of order per key"


def test_refused_records_make_the_run_partial_unless_allowed(nats_url, unique_name):
    rows = [*_rows(20), {"k": None, "i": 99}, {"i": 100}]

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        strict = await publish_run(
            nc, unique_name, records_from_rows(rows, key_field="k"), producer_id="strict"
        )
        lenient = await publish_run(
            nc,
            unique_name,
            records_from_rows(rows, key_field="k"),
            producer_id="lenient",
            allow_refused=True,
        )
        await nc.close()
        return strict.record, lenient.record

    strict, lenient = asyncio.run(go())
    assert strict.status == "partial" and strict.refused == 2 and strict.acked == 20
    assert strict.refused_reasons == {"no key": 2}
    assert [e["where"] for e in strict.refused_examples] == ["record 21", "record 22"]
    assert lenient.status == "complete" and lenient.refused == 2


def test_a_run_of_a_deleted_and_recreated_stream_is_published_again(nats_url, unique_name):
    rows = _rows(40)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        await publish_run(nc, unique_name, records_from_rows(rows, key_field="k"), producer_id="r")
        await nc.jetstream().delete_stream(unique_name)
        await provision(nc, StreamSpec(unique_name, partitions=2))
        again = await publish_run(
            nc, unique_name, records_from_rows(rows, key_field="k"), producer_id="r"
        )
        stored = (await nc.jetstream().stream_info(unique_name)).state.messages
        await nc.close()
        return again, stored

    again, stored = asyncio.run(go())
    assert not again.skipped and stored == 40


@pytest.mark.parametrize(
    "rows",
    [
        # keyless records take positions too (round-robin), in the same order on resume
        [{"k": "k1"}, {"k": None, "x": 1}, {"k": "k2"}, {"k": "k3"}, {"k": "k4"}],
        # a refused record (too large) takes no position, on the first attempt or the resume
        [{"k": "k1"}, {"k": "k1", "big": "x" * 2_000_000}, {"k": "k2"}, {"k": "k3"}],
    ],
    ids=["keyless-mixed-in", "refused-mixed-in"],
)
def test_resume_is_exact_with_keyless_and_refused_records(nats_url, unique_name, rows):
    keyless = any(r["k"] is None for r in rows)
    config = PublisherConfig(ack_timeout=0.3, delivery_timeout=0.6, allow_keyless=keyless)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1, duplicate_window=2))
        with pytest.raises(Interrupted):
            await publish_run(
                nc,
                unique_name,
                _failing_after(rows, 3),
                producer_id="r",
                config=config,
                allow_refused=True,
            )
        await asyncio.sleep(2.5)  # past the duplicate window
        done = await publish_run(
            nc,
            unique_name,
            records_from_rows(rows, key_field="k"),
            producer_id="r",
            config=config,
            allow_refused=True,
        )
        stored = [s.data for s in await read_stream(nc, unique_name)]
        await nc.close()
        return done.record, stored

    rec, stored = asyncio.run(go())
    published = [json.dumps(r, separators=(",", ":")).encode() for r in rows if "big" not in r]
    assert stored == published, "a record was lost, duplicated or moved on resume"
    assert rec.status == "complete" and rec.refused == sum("big" in r for r in rows)


def test_an_attempt_killed_before_it_recorded_anything_is_resumed_from_the_stream(
    nats_url, unique_name
):
    """What a SIGKILLed attempt leaves: records stored, the ledger saying 'running' with no
    counts. Past the duplicate window, the partition's tail (this run's last position)
    is what keeps the resume from storing them again."""
    rows = _rows(60)

    async def go():
        nc = await nats.connect(nats_url)
        await provision(nc, StreamSpec(unique_name, partitions=1, duplicate_window=2))
        await (await RunLedger.open(nc, unique_name)).begin("killed")
        cfg = PublisherConfig(ack_timeout=0.3, delivery_timeout=0.6, producer_id="killed")
        async with OrderedPublisher(nc, unique_name, cfg) as pub:  # the attempt, unrecorded
            for rec in list(records_from_rows(rows, key_field="k"))[:25]:
                await pub.publish(rec.key, rec.payload)
        await asyncio.sleep(2.5)
        done = await publish_run(
            nc,
            unique_name,
            records_from_rows(rows, key_field="k"),
            producer_id="killed",
            config=QUICK,
        )
        stored = [s.data for s in await read_stream(nc, unique_name)]
        await nc.close()
        return done.record, stored

    rec, stored = asyncio.run(go())
    assert stored == [json.dumps(r, separators=(",", ":")).encode() for r in rows]
    assert rec.skipped == 25 and rec.status == "complete"
