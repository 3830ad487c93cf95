"""The sink's batch-at-a-time paths (issue 33, goal 3), without Spark: the payload JSON built
by Arrow's string kernels is byte for byte ``json.dumps`` of each row, and a routed task's
batch path (:meth:`ResumingPublisher.publish_routed`) stores the same messages, msg-ids,
digests and refusals as the row-by-row :meth:`ResumingPublisher.publish`."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from streamcheck import read_stream

pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402

from airflow_nats_ordered.core.errors import RecordError  # noqa: E402
from airflow_nats_ordered.core.publish.config import PublisherConfig  # noqa: E402
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision  # noqa: E402
from airflow_nats_ordered.core.stream.partitioning import partition_for  # noqa: E402
from airflow_nats_ordered.spark.records import _json_default, rows_as_json  # noqa: E402
from airflow_nats_ordered.spark.resume import ResumingPublisher  # noqa: E402


def _dumps(rows: list[dict]) -> list[bytes]:
    return [
        json.dumps(r, separators=(",", ":"), ensure_ascii=False, default=_json_default).encode()
        for r in rows
    ]


def test_arrow_built_json_is_json_dumps_for_every_column_kind():
    schema = pa.schema(
        [
            ("s", pa.string()),  # no character to escape: Arrow's path
            ("e", pa.string()),  # one value to escape: the column goes value by value
            ("i8", pa.int8()),
            ("u64", pa.uint64()),
            ("i64", pa.int64()),
            ("b", pa.bool_()),
            ("f", pa.float64()),
            ("ls", pa.large_string()),
            ("n", pa.null()),
            ("bin", pa.binary()),
        ]
    )
    rows = [
        {"s": "日本 é", "e": "a", "i8": -128, "u64": 2**64 - 1, "i64": -(2**63), "b": True,
         "f": 0.1, "ls": "x", "n": None, "bin": b"\x00"},
        {"s": None, "e": 'q"\\\x1f\n', "i8": None, "u64": 0, "i64": None, "b": None,
         "f": None, "ls": None, "n": None, "bin": None},
        {"s": "", "e": None, "i8": 0, "u64": None, "i64": 2**63 - 1, "b": False,
         "f": 1e16, "ls": "\u2028", "n": None, "bin": b""},
    ]  # fmt: skip
    batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    assert rows_as_json(batch, batch.schema.names) == _dumps(batch.to_pylist())
    names = ["b", "s"]  # a subset, in another order than the schema's
    assert rows_as_json(batch, names) == _dumps([{c: r[c] for c in names} for r in rows])
    every_null = pa.RecordBatch.from_pylist([{"s": None}, {"s": None}], schema=schema)
    assert rows_as_json(every_null, ["s", "i64"]) == [b'{"s":null,"i64":null}'] * 2
    assert rows_as_json(batch.slice(0, 0), names) == []
    assert rows_as_json(batch, []) == [b"{}"] * 3


KEYS = ["k0", "k1", "k2", "k3", "", None, "k4", "k\x00", "日本", "k5"]


def _batch(partitions: int) -> tuple[list, list[bytes], list[int | None]]:
    """Rows as a routed task gets them (partition by partition, input order within), with
    keyless rows (refused) and a too large row (refused) among them."""
    rows = [(KEYS[i % len(KEYS)], b'{"i":%d}' % i) for i in range(200)]
    rows[77] = ("k3", b"x" * 1_100_000)  # over max_payload: refused, takes no position
    part = [None if not k else partition_for(k, partitions) for k, _ in rows]
    order = sorted(range(len(rows)), key=lambda i: -1 if part[i] is None else part[i])
    return [rows[i][0] for i in order], [rows[i][1] for i in order], [part[i] for i in order]


def _publish(url: str, stream: str, batched: bool) -> tuple:
    async def go():
        nc = await nats.connect(url)
        try:
            await provision(nc, StreamSpec(stream, partitions=4))
            pub = ResumingPublisher(
                nc, stream, PublisherConfig(producer_id="run-b"), resume={}, run="run-b", label="t"
            )
            await pub.start()
            keys, payloads, parts = _batch(4)
            refused: list[tuple[int, str]] = []
            if batched:
                assert not pub.resuming(parts)
                half = len(keys) // 2  # two batches: ranks and digests carry over
                for lo, hi in ((0, half), (half, len(keys))):
                    await pub.publish_routed(
                        keys[lo:hi],
                        payloads[lo:hi],
                        parts[lo:hi],
                        [None] * (hi - lo),
                        lambda i, exc, lo=lo: refused.append((lo + i, type(exc).__name__)),
                    )
            else:
                for i, (k, data, p) in enumerate(zip(keys, payloads, parts, strict=True)):
                    try:
                        await pub.publish(k, data, partition=p)
                    except RecordError as exc:
                        refused.append((i, type(exc).__name__))
            await pub.close()
            stored = [
                (m.subject.rsplit(".", 1)[1], m.msg_id, m.key, m.data)
                for m in await read_stream(nc, stream)
            ]
            return pub.digests(), refused, stored
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_routed_batch_stores_what_row_by_row_publishing_stores(nats_url, unique_name):
    digests, refused, stored = _publish(nats_url, f"{unique_name}_ROWS", batched=False)
    b_digests, b_refused, b_stored = _publish(nats_url, f"{unique_name}_BATCH", batched=True)
    assert refused and {r for _, r in refused} == {"KeylessRecordError", "RecordTooLargeError"}
    assert b_refused == refused
    assert b_digests == digests and len(digests) >= 2
    assert b_stored == stored and len(stored) == 200 - len(refused)
