"""A refused record's key is kept in its run's examples in a JSON-safe form (issue 28 item 10):
a binary key that is not UTF-8 used to reach the ledger's JSON as bytes, the ledger write
failed (``Object of type bytes is not JSON serializable``) and the run stayed ``running``
with its good records stored. Now the run is recorded (``complete`` with allow_refused), the
refusal counted, and the example says which form its key is in."""

from __future__ import annotations

import asyncio
import base64
import json

import nats

from airflow_nats_ordered.core.publish.runs import RunLedger, example_key, publish_run
from airflow_nats_ordered.core.stream.keys import MAX_KEY_BYTES
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.inputs.records import InputRecord


def test_a_refused_examples_key_is_json_safe_and_says_its_form():
    assert example_key("Zürich") == {"key": "Zürich"}
    assert example_key("Zürich".encode()) == {"key": "Zürich"}  # UTF-8 bytes: their text
    assert example_key(None) == {"key": None}  # keyless
    assert example_key(b"\xff\x00\xfe") == {"key": None, "key_b64": "/wD+"}
    assert base64.b64decode(example_key(bytearray(b"\xc3("))["key_b64"]) == b"\xc3("
    assert example_key(7) == {"key": "7"}
    long = b"\xff" * (MAX_KEY_BYTES + 10)  # refused for its length and its bytes: cut
    got = example_key(long)
    assert got["key_length"] == MAX_KEY_BYTES + 10
    assert base64.b64decode(got["key_b64"]) == long[:MAX_KEY_BYTES]
    text = "é" * (MAX_KEY_BYTES + 1)
    assert example_key(text) == {"key": text[:MAX_KEY_BYTES], "key_length": 2 * len(text)}
    for key in ("Zürich", b"\xff", None, long, text, "\ud800", memoryview(b"\x80")):
        json.dumps(example_key(key))  # whatever the key, the example is JSON


def test_a_run_with_a_refused_binary_key_is_recorded_complete_with_allow_refused(
    shared_nats_server, unique_name
):
    records = [
        InputRecord("a", b"1", None, "row 1"),
        InputRecord(b"\xff\xfebad", b"2", None, "row 2"),  # type: ignore[arg-type]
        InputRecord(b"b", b"3", None, "row 3"),  # type: ignore[arg-type]
    ]

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2, storage="memory"))
            result = await asyncio.wait_for(
                publish_run(nc, unique_name, records, producer_id="bin", allow_refused=True), 60
            )
            strict = await asyncio.wait_for(
                publish_run(nc, unique_name, records, producer_id="strict"), 60
            )
            ledger = await RunLedger.open(nc, unique_name)
            return result, strict, await ledger.get("bin"), await ledger.get("strict")
        finally:
            await nc.close()

    result, strict, recorded, strict_recorded = asyncio.run(go())
    assert result.record.status == "complete" and result.record.acked == 2
    assert result.record.refused == 1 and result.record.refused_reasons == {"bad key": 1}
    assert recorded is not None and recorded.status == "complete"
    (example,) = recorded.refused_examples
    assert example["where"] == "row 2" and example["reason"] == "bad key"
    assert example["key"] is None and base64.b64decode(example["key_b64"]) == b"\xff\xfebad"
    assert "not valid UTF-8" in example["message"]
    json.dumps(result.to_dict())  # the operator's XCom
    # without allow_refused the run is recorded too: partial, its refusal counted
    assert strict.record.status == "partial" and strict_recorded is not None
    assert strict_recorded.status == "partial" and strict_recorded.refused == 1
