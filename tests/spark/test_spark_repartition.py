"""The Spark sink across a repartition (issue 18 part 2): a run partial on the old layout and
re-run with the same producerId after ``repartition`` (routed: resumed exactly by
write_ordered; a direct routed write or unrouted rows: refused before anything is sent), a
``nats_partition`` column computed for the old count (refused, naming the new count), and a
fresh routed run on the new layout."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
from spark_helpers import on_server, run_record, stored
from streamcheck import Stored

from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id
from airflow_nats_ordered.core.publish.runs import RunLedger
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.repartition import repartition

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import partition_column, register, route, write_ordered  # noqa: E402

SCHEMA = "k string, ts long, i long"


def _rows(n: int = 48, keys: int = 8) -> list[dict]:
    return [{"k": f"key-{i % keys}", "ts": 1_000 + i, "i": i} for i in range(n)]


def layout_partition(s: Stored) -> tuple[int, int]:
    """(epoch, partition) of a stored message: ``<prefix>.p.<n>`` is epoch 0,
    ``<prefix>.p.e<k>-<n>`` epoch k."""
    last = s.subject.rsplit(".", 1)[1]
    if last.startswith("e"):
        epoch, _, part = last[1:].partition("-")
        return int(epoch), int(part)
    return 0, int(last)


def once_in_order_across_layouts(rows: list[dict], got: list[Stored]) -> list[str]:
    """Every row stored exactly once (by content and msg-id), each key's rows in ``ts``
    order by stream sequence (the old layout's before the new one's), each key on one
    partition per layout: the problems found."""
    problems: list[str] = []
    ids = [s.msg_id for s in got]
    if len(set(ids)) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} msg-ids are stored twice")
    want = sorted(json.dumps(r, sort_keys=True) for r in rows)
    have = sorted(json.dumps(json.loads(s.data), sort_keys=True) for s in got)
    if want != have:
        problems.append(
            f"stored rows differ from the input: {len(have)} stored, {len(want)} input, "
            f"{len(set(want) - set(have))} input rows missing, "
            f"{len(have) - len(set(have))} stored twice"
        )
    per_key: dict[str, list[int]] = defaultdict(list)
    parts: dict[tuple[str, int], set[int]] = defaultdict(set)
    for s in sorted(got, key=lambda s: s.seq):
        row = json.loads(s.data)
        if s.key != row["k"]:
            problems.append(f"seq {s.seq}: header key {s.key!r} but row key {row['k']!r}")
        per_key[row["k"]].append(row["ts"])
        epoch, part = layout_partition(s)
        parts[(row["k"], epoch)].add(part)
    for k, values in per_key.items():
        if values != sorted(values):
            problems.append(f"key {k}: stored out of ts order: {values}")
    problems += [f"key {k} is on partitions {sorted(p)} of epoch {e}" for (k, e), p in
                 parts.items() if len(p) != 1]  # fmt: skip
    return problems[:10]


def _stream(url: str, name: str, partitions: int) -> None:
    on_server(url, lambda nc: provision(nc, StreamSpec(name, partitions=partitions)))


def _repartition(url: str, name: str, partitions: int) -> None:
    on_server(url, lambda nc: repartition(nc, name, partitions))


def _df(spark: Any, rows: list[dict]) -> Any:
    return spark.createDataFrame(rows, SCHEMA).repartition(2)


def _write(spark: Any, url: str, stream: str, rows: list[dict], producer: str, **kw: Any):
    return write_ordered(
        _df(spark, rows),
        stream=stream,
        key="k",
        order_by="ts",
        producer_id=producer,
        connection={"url": url},
        **kw,
    )


def _partial_on_the_old_layout(spark: Any, url: str, stream: str, producer: str) -> list[dict]:
    """The run stores a prefix of every partition (the rows before ts 1024, what a killed
    driver leaves) and is recorded partial (a keyless row refused without allowRefused).
    Returns the run's whole input (the same keyless row last)."""
    rows = _rows()
    keyless = {"k": None, "ts": 5_000, "i": 999}
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, url, stream, [r for r in rows if r["ts"] < 1_024] + [keyless], producer)
    rec = run_record(url, stream, producer)
    assert rec is not None and rec.status == "partial" and rec.acked == 24, rec
    return [*rows, keyless]


def test_a_routed_run_partial_before_a_repartition_resumes_exactly_after_it(
    spark, nats_url, unique_name
):
    _stream(nats_url, unique_name, 2)
    everything = _partial_on_the_old_layout(spark, nats_url, unique_name, "across")
    _repartition(nats_url, unique_name, 3)
    keyed = [r for r in everything if r["k"] is not None]
    # the first attempt after the switch is partial again (the keyless row): it carries the
    # run over and stores the rest on the new layout; the next one passes over both layouts
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, nats_url, unique_name, everything, "across")
    assert once_in_order_across_layouts(keyed, stored(nats_url, unique_name)) == []
    rec = _write(spark, nats_url, unique_name, everything, "across", allow_refused=True)
    got = stored(nats_url, unique_name)
    assert once_in_order_across_layouts(keyed, got) == []
    assert rec.status == "complete" and rec.refused == 1 and rec.skipped == 24, rec
    assert rec.before_switch["partitions"] == 2, rec
    assert sum(rec.before_switch["acked"].values()) == 24 and rec.acked == 24, rec
    # the rest went to the new layout only
    assert sorted({layout_partition(s)[0] for s in got if json.loads(s.data)["ts"] >= 1_024}) == [1]
    # on both layouts a row's msg-id is of its rank among its key's rows in the whole input
    # (issue 28 item 1), also for the rows published after the old layout's were taken out
    ranked = sorted(got, key=lambda s: (s.key, json.loads(s.data)["ts"]))
    ranks: dict[str, int] = defaultdict(int)
    for s in ranked:
        ranks[s.key] += 1
        assert s.msg_id == derive_msg_id("across", ranks[s.key], s.key, s.data), s
    # complete: a re-run sends nothing
    again = _write(spark, nats_url, unique_name, everything, "across", allow_refused=True)
    assert again.status == "complete" and len(stored(nats_url, unique_name)) == len(keyed)


def test_a_fresh_routed_run_on_a_repartitioned_stream_routes_by_the_new_count(
    spark, nats_url, unique_name
):
    _stream(nats_url, unique_name, 4)
    _repartition(nats_url, unique_name, 3)
    rows = _rows()
    rec = _write(spark, nats_url, unique_name, rows, "fresh")
    got = stored(nats_url, unique_name)
    assert rec.status == "complete" and rec.acked == len(rows), rec
    assert once_in_order_across_layouts(rows, got) == []
    assert {layout_partition(s)[0] for s in got} == {1}


def test_a_direct_routed_write_resumed_across_a_repartition_is_refused_before_sending(
    spark, nats_url, unique_name
):
    _stream(nats_url, unique_name, 2)
    everything = _partial_on_the_old_layout(spark, nats_url, unique_name, "direct")
    _repartition(nats_url, unique_name, 3)
    before = len(stored(nats_url, unique_name))
    register(spark)
    df = route(_df(spark, everything), key="k", partitions=3, order_by=["ts"])
    with pytest.raises(Exception) as err:
        (
            df.write.format("nats-ordered")
            .option("url", nats_url)
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("orderBy", "ts")
            .option("producerId", "direct")
            .option("allowRefused", "true")
            .mode("append")
            .save()
        )
    text = str(err.value)
    assert "repartitioned" in text and "3 partitions" in text, text[-2000:]
    assert "write_ordered" in text and "new producerId" in text, text[-2000:]
    assert len(stored(nats_url, unique_name)) == before


def test_an_unrouted_run_resumed_across_a_repartition_is_refused_before_sending(
    spark, nats_url, unique_name
):
    _stream(nats_url, unique_name, 2)
    rows = [*_rows(24), {"k": None, "ts": 5_000, "i": 999}]

    def write(producer: str = "unrouted") -> None:
        (
            _df(spark, rows)
            .write.format("nats-ordered")
            .option("url", nats_url)
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("producerId", producer)
            .option("allowRefused", "false")
            .mode("append")
            .save()
        )

    register(spark)
    with pytest.raises(Exception, match="allowRefused"):
        write()
    assert len(stored(nats_url, unique_name)) == 24
    _repartition(nats_url, unique_name, 3)
    with pytest.raises(Exception) as err:
        write()
    text = str(err.value)
    assert "repartitioned" in text and "3 partitions" in text, text[-2000:]
    assert "new producerId" in text, text[-2000:]
    assert len(stored(nats_url, unique_name)) == 24, "rows of the old layout stored again"


def test_a_partition_column_for_the_old_count_is_refused_naming_the_new_count(
    spark, nats_url, unique_name
):
    _stream(nats_url, unique_name, 2)
    _repartition(nats_url, unique_name, 3)
    register(spark)
    rows = _rows()
    df = _df(spark, rows).withColumn("nats_partition", partition_column("k", 2))
    df = df.repartition(2, "nats_partition").sortWithinPartitions("nats_partition", "ts")
    with pytest.raises(Exception) as err:
        (
            df.write.format("nats-ordered")
            .option("url", nats_url)
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("producerId", "oldcount")
            .mode("append")
            .save()
        )
    text = str(err.value)
    assert "3 partitions" in text and "partition_column(" in text, text[-2000:]
    assert "write_ordered" in text, text[-2000:]
    assert stored(nats_url, unique_name) == []
    rec = run_record(nats_url, unique_name, "oldcount")
    assert rec is not None and rec.status == "partial"


def test_a_run_recorded_without_digests_resumes_exactly_after_a_repartition(
    spark, nats_url, unique_name
):
    """The ledger's record of an aborted job (abort() records what the stream holds of the
    run, without digests): its old-layout positions must not be applied to the new layout,
    where no digest would catch them."""
    _stream(nats_url, unique_name, 4)
    everything = _partial_on_the_old_layout(spark, nats_url, unique_name, "nodigest")

    async def as_an_abort_records_it(nc: Any) -> None:
        ledger = await RunLedger.open(nc, unique_name)
        rec = await ledger.get("nodigest")
        assert rec is not None and rec.prefix_digests
        rec.prefix_digests = {}
        await ledger.record(rec)

    on_server(nats_url, as_an_abort_records_it)
    _repartition(nats_url, unique_name, 3)
    rec = _write(spark, nats_url, unique_name, everything, "nodigest", allow_refused=True)
    keyed = [r for r in everything if r["k"] is not None]
    assert once_in_order_across_layouts(keyed, stored(nats_url, unique_name)) == []
    assert rec.status == "complete" and rec.acked == 24, rec


def test_a_direct_write_of_a_run_write_ordered_carried_over_is_refused_before_sending(
    spark, nats_url, unique_name
):
    """write_ordered carried the run over the switch (it recorded what the old layout
    stored and passes it over) and ended partial again; a direct write of the same run now
    has positions of the new layout only, so it would store the old layout's rows again."""
    _stream(nats_url, unique_name, 2)
    everything = _partial_on_the_old_layout(spark, nats_url, unique_name, "carried")
    _repartition(nats_url, unique_name, 3)
    # the same partial input again: carried over, nothing more to store, partial (keyless)
    again = [r for r in everything if r["k"] is None or r["ts"] < 1_024]
    with pytest.raises(Exception, match="allowRefused"):
        _write(spark, nats_url, unique_name, again, "carried")
    rec = run_record(nats_url, unique_name, "carried")
    assert rec is not None and rec.status == "partial" and rec.before_switch, rec
    before = len(stored(nats_url, unique_name))
    keyed = [r for r in everything if r["k"] is not None]
    df = route(_df(spark, keyed), key="k", partitions=3, order_by=["ts"])
    register(spark)
    with pytest.raises(Exception) as err:
        (
            df.write.format("nats-ordered")
            .option("url", nats_url)
            .option("stream", unique_name)
            .option("keyColumn", "k")
            .option("orderBy", "ts")
            .option("producerId", "carried")
            .mode("append")
            .save()
        )
    assert len(stored(nats_url, unique_name)) == before, "the direct write sent rows"
    assert "write_ordered" in str(err.value) and "new producerId" in str(err.value), err.value
