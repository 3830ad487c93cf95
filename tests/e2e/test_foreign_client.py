"""A client in another language, written from docs/protocol.md alone (tests/js/, Node.js),
interoperates with the Python package: its records reach the Python workers byte-exact, on
the right partition, in order, with nothing rejected; it reads the Python publisher's
records back into the same keys; and it recomputes the page's golden vectors.

Node.js (>= 20) and npm are required, not optional: without them these tests fail and say
how to fix it. ``npm ci`` installs tests/js/package-lock.json into tests/js/node_modules once
per run when it is missing.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
from js_client import run_node
from locations import TESTS
from protocol_page import PAGE

from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.worker import Worker

JS = TESTS / "js"
P = 4
#: keys of every kind the page names: plain, and every reason for the encoded form
KEYS = [
    "customer-42",
    "N123AA",
    "a b:c~!",
    "-17",
    "h\u00e9llo",
    "\u6771\u4eac",
    "\U0001f680",
    " padded ",
    "line1\r\nline2",
    "tab\tsep",
    "nul\x00byte",
    "\u00a0nbsp",
    "\u3000ideographic",
    "del\x7f",
]
PER_KEY = 5


def test_the_js_client_recomputes_every_golden_vector_of_the_page(node):
    out = json.loads(run_node(node, "vectors.mjs", str(PAGE)))
    assert out["mismatches"] == []
    assert out["checked"] > 100


async def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_the_js_producers_records_reach_python_workers_byte_exact_in_order_none_rejected(
    node, nats_url, unique_name, tmp_path
):
    """Every key of the page's kinds, some header-safe keys in the encoded form anyway
    (which a writer may do), interleaved; one Python worker consumes them."""
    records = [
        {"key": k, "payload": json.dumps({"k": ki, "i": i}), "b64": ki % 3 == 0}
        for i in range(PER_KEY)
        for ki, k in enumerate(KEYS)
    ]
    (tmp_path / "records.json").write_text(json.dumps({"records": records}), encoding="utf-8")
    asyncio.run(_provision(nats_url, unique_name))
    produced = json.loads(
        run_node(
            node, "producer.mjs", nats_url, unique_name, "js-run-1", str(tmp_path / "records.json")
        )
    )
    assert produced["published"] == len(records) and produced["duplicates"] == 0
    marks = {int(p): s for p, s in produced["marks"].items()}

    seen: list[tuple[str, int, int]] = []  # (key, partition, i) in handling order

    def handler(msg):
        seen.append((msg.key, msg.partition, json.loads(msg.data)["i"]))

    async def consume():
        nc = await nats.connect(nats_url)
        w = Worker(nc, WorkerConfig(unique_name, "g", member_id="m1", lease_ttl=2.0), handler)
        await w.start()
        try:
            await _until(lambda: len(seen) >= len(records))
            # the producer's marks (section 7.4) are what a drain waits for
            await wait_drained(nc, unique_name, "g", marks=marks, timeout=60)
        finally:
            await w.stop()
            await nc.close()
        return w.stats

    stats = asyncio.run(consume())
    assert stats["rejected"] == 0 and stats["dead_lettered"] == 0, stats
    assert len(seen) == len(records)
    for k in KEYS:
        mine = [(p, i) for key, p, i in seen if key == k]
        assert [i for _, i in mine] == list(range(PER_KEY)), (k, mine)  # byte-exact, in order
        assert {p for p, _ in mine} == {partition_for(k, P)}, k


async def _provision(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        await provision(nc, StreamSpec(stream, partitions=P))
    finally:
        await nc.close()


def test_the_js_reader_decodes_the_python_publishers_records_into_the_same_keys(
    node, nats_url, unique_name
):
    async def publish():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=P))
            async with OrderedPublisher(
                nc, unique_name, producer_id="py-run-1", allow_keyless=True
            ) as pub:
                for i in range(PER_KEY):
                    for ki, k in enumerate(KEYS):
                        await pub.publish(k, json.dumps({"k": ki, "i": i}).encode())
                await pub.publish(None, b'{"keyless":true}')
        finally:
            await nc.close()

    asyncio.run(publish())
    read = [
        json.loads(line)
        for line in run_node(node, "reader.mjs", nats_url, unique_name).splitlines()
    ]
    assert len(read) == len(KEYS) * PER_KEY + 1
    assert [r for r in read if "error" in r or not r["routed"]] == []
    keyless = [r for r in read if r["key"] is None]
    assert [r["payload"] for r in keyless] == ['{"keyless":true}']
    for ki, k in enumerate(KEYS):
        mine = [r for r in read if r["key"] == k]
        assert [json.loads(r["payload"]) for r in mine] == [
            {"k": ki, "i": i} for i in range(PER_KEY)
        ]
        assert {r["partition"] for r in mine} == {partition_for(k, P)}
        assert [r["producer_seq"] is not None and len(r["msg_id"]) == 30 for r in mine] == [
            True
        ] * PER_KEY
