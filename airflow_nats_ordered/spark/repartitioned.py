"""A Spark run across a repartition of its stream (see
:mod:`airflow_nats_ordered.core.publish.run_layouts`).

A routed run's positions are ranks in the NATS partitions of the layout it was begun on.
When the stream is repartitioned before the run completes (a task failed for good, the
driver was killed), a re-run with the same ``producerId`` cannot resume by those positions:
the new layout's partitions hold other keys. What is exact, as the core's ``publish_run``
does it:

* :func:`~.ordered_write.write_ordered` (which routes the rows itself) carries the run over
  once (:func:`carry_over`): it records in the ledger what the old layout stored of the run
  (``before_switch``: the old epoch, its partition count and, per old partition, how many
  leading positions are stored, from the ledger or the partition's last message) and from
  then on passes over exactly those rows (:func:`pass_over_old_layout`: each row's old
  partition and its rank there, in the order the old attempt published them) before routing
  the rest by the new count. The rest keep the msg-ids they had on the old layout: a routed
  row's msg-id is of its rank among the run's rows of its key (not of its partition), and
  each row carries that rank, counted over the whole input (``KEY_RANK_COLUMN``), so a row
  the old layout stored but the recorded positions missed is de-duplicated by the stream
  inside its duplicate window. Each key's rows stay in order: the old layout stored a prefix
  of each key's rows, and consumers read the old layout before the new one.
* a direct ``format("nats-ordered")`` write of such a run, routed or not, is refused on the
  driver before anything is sent or the run is begun (:func:`refusal`): the sink sees the
  rows only inside tasks and cannot tell which of them the old layout stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.runs import RunLedger, RunRecord, stored_positions
from airflow_nats_ordered.spark.routing import KEY_RANK_COLUMN, NOT_IN_TIES, partition_column

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from pyspark.sql import DataFrame

    from airflow_nats_ordered.core.stream.partitioned import PartitionedStream

_OLD = "__nats_old_partition"
_RANK = "__nats_old_rank"


def _began_before(previous: RunRecord | None, stream: PartitionedStream) -> bool:
    return (
        previous is not None
        and previous.status != "complete"
        and previous.epoch != stream.current_epoch
    )


def refusal(
    previous: RunRecord | None,
    stream: PartitionedStream,
    *,
    routed: bool,
    carried_over: bool = False,
) -> str | None:
    """Why a direct write cannot resume ``previous`` on ``stream``'s current layout, or None.
    ``carried_over``: the write is write_ordered's, which passed over what the old layout
    stored of a run it carried over (``before_switch``)."""
    if (
        previous is not None
        and previous.status != "complete"
        and previous.before_switch
        and not carried_over
        and not _began_before(previous, stream)
    ):
        return (
            f"run {previous.producer_id!r} spans a repartition of stream {stream.name}: "
            "write_ordered carried it over and recorded what the old layout "
            f"({previous.before_switch.get('partitions')} partitions) stored of it, which "
            "only write_ordered passes over; a direct format('nats-ordered') write would "
            "store those rows again. Nothing was sent and the run was not begun. Resume it "
            "with airflow_nats_ordered.spark.write_ordered(df, stream=..., key=..., "
            f"order_by=..., producer_id={previous.producer_id!r}) on the same input, or "
            "publish the input under a new producerId (the rows the old layout stored are "
            "then stored again)"
        )
    if previous is None or not _began_before(previous, stream):
        return None
    try:
        old = stream.at_epoch(previous.epoch).partitions
    except ValueError:
        old = 0
    was = f"{old} partitions, epoch {previous.epoch}" if old else f"epoch {previous.epoch}"
    head = (
        f"run {previous.producer_id!r} was begun on stream {stream.name}'s earlier layout "
        f"({was}) and is {previous.status} there; the stream was repartitioned since to "
        f"{stream.current_partitions} partitions (epoch {stream.current_epoch}), so rows "
        "now go to other NATS partitions under other msg-ids, and resuming the run here "
        "would store again what the old layout already holds. Nothing was sent and the run "
        "was not begun. "
    )
    if routed:
        return head + (
            "Resume it exactly with airflow_nats_ordered.spark.write_ordered(df, stream=..., "
            f"key=..., order_by=..., producer_id={previous.producer_id!r}) on the same input "
            "(it passes over what the old layout stored and publishes the rest on the new "
            "layout), or publish the input under a new producerId (the rows the old layout "
            "stored are then stored again)"
        )
    return head + (
        "Its rows were not routed (no nats_partition column), so what the old layout stored "
        "of each Spark task cannot be told from the input. Publish under a new producerId "
        "only the rows not stored yet (or all of them, if consumers accept the old layout's "
        "rows twice), or publish such runs with airflow_nats_ordered.spark.write_ordered, "
        "whose runs resume exactly across a repartition"
    )


async def carry_over(
    nc: NATS, ledger: RunLedger, previous: RunRecord | None
) -> tuple[int, dict[int, int]] | None:
    """For :func:`~.ordered_write.write_ordered`: the old layout's partition count and
    stored positions to pass over (recorded once as ``before_switch``, the run then on the
    current epoch), or None when the run has nothing of an earlier layout."""
    if previous is None or previous.status == "complete":
        return None
    stream = ledger.stream
    if previous.epoch == stream.current_epoch:
        b = previous.before_switch
        if not b:
            return None
        return int(b["partitions"]), {int(p): int(n) for p, n in b["acked"].items()}
    if previous.before_switch:
        raise ConfigError(
            f"run {previous.producer_id!r} was begun before two repartitions of stream "
            f"{stream.name} (epochs {previous.before_switch.get('epoch')} and "
            f"{previous.epoch}); it cannot be resumed exactly: publish it under a new "
            "producer_id (the rows it stored are then stored again)"
        )
    old = stream.at_epoch(previous.epoch)
    stored, _ = await stored_positions(nc, old, previous.producer_id, previous)
    previous.before_switch = {
        "epoch": old.epoch,
        "partitions": old.partitions,
        "acked": {str(p): n for p, n in stored.items() if n},
    }
    # its positions, marks and digests were the old layout's partitions'; the attempt on
    # the new layout starts them again (as the core's RunLedger.begin does)
    previous.acked_per_partition, previous.high_water_marks, previous.prefix_digests = {}, {}, {}
    previous.epoch = stream.current_epoch
    await ledger.record(previous)
    return old.partitions, {p: n for p, n in stored.items() if n}


def pass_over_old_layout(
    df: DataFrame,
    *,
    key: str,
    order_by: Sequence[str],
    tie_breaker: Sequence[str] | None,
    partitions: int,
    stored: Mapping[int, int],
) -> DataFrame:
    """``df`` without the rows the old layout of ``partitions`` partitions stored: per old
    partition, its first ``stored[p]`` keyed rows in the order :func:`~.routing.route`
    published them (``order_by``, then the same tie-breaker). Keyless rows are kept (they
    took no position; refused again unless allowRefused). Every keyed row kept carries its
    rank among the input's rows of its key in that order (``KEY_RANK_COLUMN``), counted
    before the stored rows are taken out: the rank its msg-id had on the old layout."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if not stored:
        return df
    row = [F.col(c) for c in df.columns if c not in NOT_IN_TIES]
    ties = [F.col(c) for c in tie_breaker] if tie_breaker else [F.col(key), F.xxhash64(*row)]
    keyed = F.col(key).isNotNull() & (F.length(F.col(key).cast("string")) > 0)
    old = F.when(keyed, partition_column(key, partitions))
    limits = F.create_map(*[F.lit(x) for p, n in sorted(stored.items()) for x in (p, n)])
    marked = df.withColumn(_OLD, old)
    order = [*[F.col(c) for c in order_by], *ties]
    win = Window.partitionBy(_OLD).orderBy(*order)
    per_key = Window.partitionBy(_OLD, F.col(key)).orderBy(*order)
    ranked = marked.withColumn(_RANK, F.row_number().over(win)).withColumn(
        KEY_RANK_COLUMN, F.when(keyed, F.row_number().over(per_key))
    )
    keep = F.when(F.col(_OLD).isNull(), F.lit(True)).otherwise(
        F.col(_RANK) > F.coalesce(F.element_at(limits, F.col(_OLD)), F.lit(0))
    )
    return ranked.filter(keep).drop(_OLD, _RANK)
