"""docs/protocol.md is the contract a client in another language is written from: every
golden vector, check value, worked example and KV record example on the page must be what
the code computes, sends and stores."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import mmh3
import nats
import pytest
from protocol_page import golden_vectors, kv_examples, page_text

from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.runs import _key as run_key
from airflow_nats_ordered.core.publish.runs import ledger_bucket, publish_run
from airflow_nats_ordered.core.stream.keys import key_header, message_key
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, describe, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for, partition_subject
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

VECTORS = golden_vectors()
RECORDS = VECTORS["records"]


def _kb(rec: dict) -> bytes:
    return b"" if rec["key"] is None else rec["key"].encode("utf-8")


@pytest.mark.parametrize("rec", RECORDS, ids=[repr(r["key"]) for r in RECORDS])
def test_each_golden_vector_has_the_partition_msg_id_and_key_header_the_code_gives(rec):
    p, kb = VECTORS["partitions"], _kb(rec)
    if rec["key"] is not None:
        assert kb.hex() == rec["key_utf8_hex"]
        assert mmh3.hash(kb, 0, signed=False) == rec["murmur3"]
        assert partition_for(rec["key"], p) == rec["partition"]
        name, value = key_header(rec["key"])
        assert {"name": name, "value": value.decode("ascii")} == rec["key_header"]
        # what a reader makes of the header the page shows: the key, byte-exact
        assert message_key({name: value.decode("ascii")}) == rec["key"]
    else:
        assert rec["key_header"] is None and "Nats-Ordered-Key" not in rec["headers"]
    assert rec["subject"] == partition_subject(VECTORS["prefix"], rec["partition"])
    msg_id = derive_msg_id(VECTORS["producer_id"], rec["index"], kb, rec["payload"].encode())
    assert msg_id == rec["msg_id"]


def test_the_golden_positions_are_each_records_place_among_its_partitions_records():
    seen: dict[int, int] = {}
    for rec in RECORDS:
        seen[rec["partition"]] = seen.get(rec["partition"], 0) + 1
        assert rec["seq"] == seen[rec["partition"]], rec


def test_the_golden_indexes_are_each_records_place_in_the_input_and_the_id_has_no_layout():
    """Section 6: the msg-id is of the producer id and the record's place in the input, so
    the same record on another layout (another partition, another position) has the same id."""
    assert [rec["index"] for rec in RECORDS] == list(range(1, len(RECORDS) + 1))
    for rec in RECORDS:
        assert rec["msg_id"] == derive_msg_id(
            VECTORS["producer_id"], rec["index"], _kb(rec), rec["payload"].encode()
        )
    assert len({rec["msg_id"] for rec in RECORDS}) == len(RECORDS)


def test_the_golden_vectors_cover_both_key_forms_keyless_and_every_murmur3_tail_length():
    forms = {r["key_header"]["name"] for r in RECORDS if r["key_header"]}
    assert forms == {"Nats-Ordered-Key", "Nats-Ordered-Key-B64"}
    assert any(r["key"] is None for r in RECORDS)
    assert {len(_kb(r)) % 4 for r in RECORDS if r["key"]} == {0, 1, 2, 3}
    assert any(r["murmur3"] and r["murmur3"] >= 2**31 for r in RECORDS)  # unsigned matters
    assert max(r["seq"] for r in RECORDS) > 1


@pytest.mark.parametrize("vec", VECTORS["partition_vectors"], ids=lambda v: repr(v))
def test_partition_vectors_for_other_partition_counts(vec):
    assert mmh3.hash(vec["key"].encode(), 0, signed=False) == vec["murmur3"]
    assert partition_for(vec["key"], vec["partitions"]) == vec["partition"]


def test_the_pages_murmur3_check_values_and_worked_examples_are_the_codes():
    text = page_text()
    checks = re.findall(r'`"([^"`]*)"` →\s+`0x([0-9a-f]{8})`', text)
    assert len(checks) >= 7, checks
    for key, hexval in checks:
        assert mmh3.hash(key.encode(), 0, signed=False) == int(hexval, 16), key
    # section 6's worked example: the preimage bytes and the id
    block = re.search(r"The preimage is (\d+) bytes:\n\n```\n(.*?)\n```", text, re.S)
    assert block, "section 6 lost its worked preimage"
    preimage = bytes.fromhex(
        " ".join(re.sub(r'".*"', "", line) for line in block.group(2).splitlines())
    )
    assert len(preimage) == int(block.group(1))
    assert preimage == b'golden-run-1\x001\x00customer-42\x00{"order":1}'
    expected = derive_msg_id("golden-run-1", 1, "customer-42", b'{"order":1}')
    assert f"and `msg_id = {expected}`" in text
    # section 9.4: the run ledger key of a producer id
    assert f"`golden-run-1` → `{run_key('golden-run-1')}`" in text


async def _raw_message(nc, stream: str, seq: int) -> tuple[str, bytes, bytes]:
    """``(subject, header block, payload)`` of message ``seq`` exactly as the server stores
    it (the JetStream API's message get, not a client's parsed headers)."""
    resp = await nc.request(
        f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps({"seq": seq}).encode(), timeout=10
    )
    msg = json.loads(resp.data)["message"]
    return (
        msg["subject"],
        base64.b64decode(msg.get("hdrs", "")),
        base64.b64decode(msg.get("data", "")),
    )


def test_the_publisher_stores_each_golden_record_on_its_subject_with_the_pages_header_block(
    nats_server,
):
    """A fresh server, so the page's stream name and subjects are free."""

    async def go():
        nc = await nats.connect(nats_server.url)
        try:
            await provision(nc, StreamSpec(VECTORS["stream"], partitions=VECTORS["partitions"]))
            async with OrderedPublisher(
                nc, VECTORS["stream"], producer_id=VECTORS["producer_id"], allow_keyless=True
            ) as pub:
                for rec in RECORDS:
                    part = await pub.publish(rec["key"], rec["payload"].encode())
                    assert part == rec["partition"], rec
            return [await _raw_message(nc, VECTORS["stream"], i + 1) for i in range(len(RECORDS))]
        finally:
            await nc.close()

    stored = asyncio.run(go())
    # partitions are sent concurrently: match stored records to vectors by partition order
    by_subject: dict[str, list[tuple[bytes, bytes]]] = {}
    for subject, hdrs, data in stored:
        by_subject.setdefault(subject, []).append((hdrs, data))
    for rec in RECORDS:
        assert len(by_subject.get(rec["subject"], [])) >= rec["seq"], rec
        hdrs, data = by_subject[rec["subject"]][rec["seq"] - 1]
        assert hdrs == rec["headers"].encode("utf-8"), (rec["key"], hdrs)
        assert data == rec["payload"].encode("utf-8"), rec["key"]
    assert sum(map(len, by_subject.values())) == len(RECORDS)


def test_a_provisioned_stream_has_the_pages_subjects_and_metadata(nats_url, unique_name):
    """Section 2: one explicit subject per partition, and the five metadata keys."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3))
            return (await describe(nc, unique_name)).config
        finally:
            await nc.close()

    cfg = asyncio.run(go())
    prefix = unique_name.lower()
    assert cfg.subjects == [f"{prefix}.p.0", f"{prefix}.p.1", f"{prefix}.p.2"]
    ours = {k: v for k, v in (cfg.metadata or {}).items() if k.startswith("nats-ordered.")}
    assert ours == {
        "nats-ordered.partitions": "3",
        "nats-ordered.hash": "murmur3_x86_32",
        "nats-ordered.seed": "0",
        "nats-ordered.prefix": prefix,
        "nats-ordered.format": "1",
    }
    assert cfg.allow_batched and cfg.allow_direct


class _Rec:
    def __init__(self, key: str, payload: bytes, where: str) -> None:
        self.key, self.payload, self.msg_id, self.where = key, payload, None, where


async def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


def test_the_pages_kv_record_examples_have_the_fields_the_code_writes(nats_url, unique_name):
    """Section 9: a monitor written from the page finds exactly the documented fields in
    the lease, heartbeat, commit, stream, assignment and run ledger records."""
    examples = kv_examples()
    assert set(examples) == {
        "lease p.<n>",
        "heartbeat m.<member>",
        "commit c.<n>",
        "stream",
        "assignment",
        "run record",
    }

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            recs = [_Rec(f"k{i}", b"{}", f"line {i}") for i in range(6)]
            result = await publish_run(nc, unique_name, recs, producer_id="golden-run-1")
            w = Worker(nc, WorkerConfig(unique_name, "g", member_id="m1", lease_ttl=2.0), print)
            await w.start()
            try:
                await wait_drained(
                    nc, unique_name, "g", marks=result.record.high_water_marks, timeout=60
                )
                js = nc.jetstream()
                leases = await js.key_value(f"nor_{unique_name}_g_leases")
                state = await js.key_value(f"nor_{unique_name}_g_state")
                runs = await js.key_value(ledger_bucket(unique_name))

                async def lease_held() -> bool:
                    try:
                        await leases.get("p.0")
                        return True
                    except Exception:
                        return False

                await _until(lease_held)
                got = {
                    "lease p.<n>": (await leases.get("p.0")).value,
                    "heartbeat m.<member>": (await leases.get("m.m1")).value,
                    "commit c.<n>": (await state.get("c.0")).value,
                    "stream": (await state.get("stream")).value,
                    "assignment": (await state.get("assignment")).value,
                    "run record": (await runs.get(run_key("golden-run-1"))).value,
                }
            finally:
                await w.stop()
            return {k: json.loads(v) for k, v in got.items()}
        finally:
            await nc.close()

    real = asyncio.run(go())
    for name, example in examples.items():
        assert list(real[name]) == list(example), name  # the same fields, in the same order
        for field, value in example.items():
            got = real[name][field]
            numbers = isinstance(value, int | float) and isinstance(got, int | float)
            assert numbers or value is None or isinstance(got, type(value)), (name, field, got)
