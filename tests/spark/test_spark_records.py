"""Arrow batches to records, without Spark: the payload JSON and the order check."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402

from airflow_nats_ordered.spark.options import SinkOptions  # noqa: E402
from airflow_nats_ordered.spark.records import (  # noqa: E402
    BatchRecords,
    DisorderError,
    _json_default,
    rows_as_json,
)


def _options(**kw) -> SinkOptions:
    return SinkOptions.from_spark({"stream": "S", "keyColumn": "k", "producerId": "p", **kw})


def test_column_wise_json_is_exactly_json_dumps_of_each_row():
    rows = [
        {
            "k": 'é "q" \\ \n',
            "n": 1,
            "b": True,
            "f": 1.5,
            "d": dt.date(2013, 1, 1),
            "t": dt.datetime(2013, 1, 1, 5, 15, tzinfo=dt.UTC),
            "m": decimal.Decimal("1.10"),
            "raw": b"\x00\xff",
            "l": [1, 2],
            "s": {"x": "y"},
        },
        {
            "k": None,
            "n": None,
            "b": None,
            "f": float("nan"),
            "d": None,
            "t": None,
            "m": None,
            "raw": None,
            "l": None,
            "s": None,
        },
        {
            "k": "日本",
            "n": -(2**62),
            "b": False,
            "f": None,
            "d": dt.date(2024, 2, 29),
            "t": dt.datetime(2024, 2, 29, tzinfo=dt.UTC),
            "m": decimal.Decimal("0"),
            "raw": b"",
            "l": [],
            "s": {"x": None},
        },
    ]
    batch = pa.RecordBatch.from_pylist(rows)
    want = [
        json.dumps(r, separators=(",", ":"), ensure_ascii=False, default=_json_default).encode()
        for r in batch.to_pylist()
    ]
    assert rows_as_json(batch, batch.schema.names) == want


def _records(maker: BatchRecords, rows: list[dict]) -> list:
    return maker.records(pa.RecordBatch.from_pylist(rows))


def test_order_is_checked_per_partition_nulls_first_across_batches():
    maker = BatchRecords(_options(orderBy="a,b"), ["k", "a", "b"], 4, "task 0")
    # interleaved keys, each in (a, b) order; nulls sort first as in Spark
    _records(
        maker,
        [
            {"k": "x", "a": None, "b": 1},
            {"k": "y", "a": 1, "b": 5},
            {"k": "x", "a": 1, "b": None},
            {"k": "x", "a": 1, "b": 0},
            {"k": "y", "a": 1, "b": 5},
            {"k": "y", "a": 2, "b": 0},
        ],
    )
    _records(maker, [{"k": "x", "a": 1, "b": 0}, {"k": "y", "a": 2, "b": 1}])
    with pytest.raises(DisorderError, match=r"row 9: .*a=1, b=4 after a=2, b=1"):
        _records(maker, [{"k": "x", "a": 3, "b": 0}, {"k": "y", "a": 1, "b": 4}])


def test_disorder_inside_a_batch_names_the_row_and_values():
    maker = BatchRecords(_options(orderBy="ts"), ["k", "ts"], 2, "task 3")
    with pytest.raises(DisorderError, match=r"task 3, row 2: .*ts=None after ts=7.*write_ordered"):
        _records(maker, [{"k": "x", "ts": 5}, {"k": "x", "ts": 7}, {"k": "x", "ts": None}])


def test_keyless_rows_are_not_order_checked_and_reach_the_publisher_to_be_refused():
    maker = BatchRecords(_options(orderBy="ts"), ["k", "ts"], 2, "t")
    recs = _records(maker, [{"k": None, "ts": 9}, {"k": "x", "ts": 1}, {"k": None, "ts": 0}])
    assert [r.key for r in recs] == [None, "x", None] and recs[2].where == "t, row 2"


def test_integral_keys_are_their_decimal_text_and_route_like_it():
    """The canonical key-text rule in a task: an integer key is published as its exact
    decimal digits, on the partition of that text; write_ordered's key-text column is not
    part of the payload."""
    from airflow_nats_ordered.core.stream.partitioning import partition_for

    keys = [9223372036854775807, -9223372036854775808, -5, 0, None]
    batch = pa.RecordBatch.from_pydict({"k": pa.array(keys, pa.int64()), "v": [1, 2, 3, 4, 5]})
    recs = BatchRecords(_options(), ["k", "v"], 8, "t").records(batch)
    texts = [None if k is None else str(k) for k in keys]
    assert [r.key for r in recs] == texts
    from airflow_nats_ordered.spark.routing import partitions_of

    assert partitions_of(batch.column("k"), 8).to_pylist() == [
        None if t is None else partition_for(t, 8) for t in texts
    ]
    hidden = pa.RecordBatch.from_pydict(
        {"k": pa.array([42], pa.int32()), "nats_key": ["42"], "v": [1]}
    )
    (rec,) = BatchRecords(_options(keyColumn="nats_key"), ["k", "nats_key", "v"], 8, "t").records(
        hidden
    )
    assert rec.key == "42" and json.loads(rec.payload) == {"k": 42, "v": 1}


def test_a_routing_column_that_is_not_the_streams_routing_is_refused_before_any_record():
    """Issue 17 item 3: ``nats_partition`` is checked against murmur3 of each key, and a
    task's rows must come partition by partition, before a record of the batch is made."""
    from airflow_nats_ordered.core.stream.partitioning import partition_for
    from airflow_nats_ordered.spark.records import RoutingError

    keys = ["a", "b", "c", "d", "e", "f"]
    right = sorted((partition_for(k, 4), k) for k in keys)
    cols = ["k", "nats_partition"]
    ok = BatchRecords(_options(), cols, 4, "t").records(
        pa.RecordBatch.from_pylist([{"k": k, "nats_partition": p} for p, k in right])
    )
    assert [r.key for r in ok] == [k for _, k in right]
    p, k = right[2]
    wrong = [{"k": k2, "nats_partition": p2} for p2, k2 in right]
    wrong[2]["nats_partition"] = (p + 1) % 4
    maker = BatchRecords(_options(), cols, 4, "task 1")
    with pytest.raises(
        RoutingError, match=rf"task 1, row 2: column 'nats_partition' is {(p + 1) % 4}"
    ):
        _records(maker, wrong)
    assert maker.rows == 0
    unsorted = [{"k": k2, "nats_partition": p2} for p2, k2 in reversed(right)]
    if right[0][0] != right[-1][0]:
        with pytest.raises(RoutingError, match="partition by partition"):
            _records(BatchRecords(_options(), cols, 4, "t"), unsorted)
    # a keyless row's column is not checked (the publisher refuses or round-robins it)
    _records(BatchRecords(_options(), cols, 4, "t"), [{"k": None, "nats_partition": 3}])


def test_partitions_of_hashes_distinct_keys_as_partition_for_does_each_key():
    from airflow_nats_ordered.core.stream.partitioning import partition_for
    from airflow_nats_ordered.spark.routing import partitions_of

    texts = ["a", None, "abcde", "a", "日本", "", "a", None, "x" * 1001]
    assert partitions_of(pa.array(texts), 7).to_pylist() == [
        None if k is None else partition_for(k, 7) for k in texts
    ]
    raw = [b"k1", None, b"k1", b"\xc3\xa9"]
    assert partitions_of(pa.array(raw, pa.binary()), 5).to_pylist() == [
        None if k is None else partition_for(k, 5) for k in raw
    ]
    ints = [-5, 0, None, 2**63 - 1, -5]
    assert partitions_of(pa.array(ints, pa.int64()), 16).to_pylist() == [
        None if k is None else partition_for(str(k), 16) for k in ints
    ]
    assert partitions_of(pa.array([None, None]), 3).to_pylist() == [None, None]
