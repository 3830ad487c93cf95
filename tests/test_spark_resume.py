"""A Spark run resumed with the same producerId: exact on the same input, refused on changed
input (issue 17 item 1), and from what the stream holds after an abort (item 2)."""

from __future__ import annotations

import json

import pytest
from spark_helpers import exactly_once_in_order, on_server, run_record, stored

from airflow_nats_ordered.core.streams import StreamSpec, provision

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import write_ordered  # noqa: E402

SCHEMA = "k string, ts long, i long, pad string"


def _rows(n: int = 60, keys: int = 6) -> list[dict]:
    return [{"k": f"key-{i % keys}", "ts": 1_000 + i, "i": i, "pad": ""} for i in range(n)]


def _write(spark, url: str, stream: str, rows: list[dict], producer: str, **kw):
    df = spark.createDataFrame(rows, SCHEMA).repartition(2)
    return write_ordered(
        df,
        stream=stream,
        key="k",
        order_by="ts",
        producer_id=producer,
        connection={"url": url},
        **kw,
    )


def _problems(rows: list[dict], url: str, stream: str) -> list[str]:
    return exactly_once_in_order(rows, stored(url, stream), "k", "ts")


@pytest.mark.parametrize("fault", ["too large", "no key"])
def test_a_refused_row_corrected_and_re_run_with_the_same_producer_id_is_refused(
    spark, nats_url, unique_name, fault
):
    spec = StreamSpec(unique_name, partitions=2, max_msg_size=64 * 1024)
    on_server(nats_url, lambda nc: provision(nc, spec))
    rows = _rows()
    bad = dict(rows[20])
    if fault == "too large":
        bad["pad"] = "x" * 70_000
    else:
        bad["k"] = None
    first = [bad if r["i"] == 20 else r for r in rows]
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, nats_url, unique_name, first, "fixme")
    rec = run_record(nats_url, unique_name, "fixme")
    assert rec is not None and rec.status == "partial" and rec.refused == 1
    good = [r for r in rows if r["i"] != 20]
    assert _problems(good, nats_url, unique_name) == []

    # the user "fixes the input" and runs the same producerId again: the resume would pass
    # over the first n positions of the corrected partition, which now hold other rows
    # (the old code: the corrected row missing, a later row of its partition stored twice)
    try:
        _write(spark, nats_url, unique_name, rows, "fixme")
        err = None
    except Exception as exc:
        err = exc
    assert _problems(good, nats_url, unique_name) == [], "rows sent after a changed prefix"
    assert err is not None, "the changed input was resumed"
    assert "input changed" in str(err) and "new producerId" in str(err), str(err)[-1500:]
    assert "new producerId" in (rec.error or ""), rec.error  # the first refusal says so too

    # the same input again resumes exactly; allowRefused publishes the rest and succeeds
    again = _write(spark, nats_url, unique_name, first, "fixme", allow_refused=True)
    assert again.status == "complete" and again.refused == 1
    # and the corrected input under a new producer id is a new run
    fixed = _write(spark, nats_url, unique_name, rows, "fixed")
    assert fixed.status == "complete" and fixed.acked == len(rows)


def test_resuming_a_partial_run_on_the_same_input_stores_every_row_once(
    spark, nats_url, unique_name
):
    spec = StreamSpec(unique_name, partitions=3)
    on_server(nats_url, lambda nc: provision(nc, spec))
    rows = _rows(90)
    first = [dict(r, k=None) if r["i"] % 10 == 3 else r for r in rows]
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, nats_url, unique_name, first, "same")
    rec = run_record(nats_url, unique_name, "same")
    assert rec is not None and sorted(rec.prefix_digests) == sorted(rec.acked_per_partition)
    ok = _write(spark, nats_url, unique_name, first, "same", allow_refused=True)
    assert ok.status == "complete" and ok.skipped == len(rows) - 9 and ok.acked == len(rows) - 9
    want = [r for r in first if r["k"] is not None]
    assert _problems(want, nats_url, unique_name) == []
    assert json.loads(stored(nats_url, unique_name)[0].data)["k"] is not None
