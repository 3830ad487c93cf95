"""``route()`` spreads NATS partitions evenly over its Spark tasks (issue 17 item 10).

Each task publishes whole NATS partitions; with the partition number hashed by Spark's
``repartition`` 16 partitions went 7/9 to 2 tasks and 4 went 1/3, so one task published most
rows while the other core idled (the write lasts as long as its biggest task). Partition ``p``
now goes to task ``p % tasks``. No NATS server is needed: this is the layout alone.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import functions as F  # noqa: E402

from airflow_nats_ordered.core.errors import ConfigError  # noqa: E402
from airflow_nats_ordered.spark import PARTITION_COLUMN, route  # noqa: E402


def _layout(spark, partitions: int, tasks: int) -> dict[int, set[int]]:
    """Spark task -> the NATS partitions it holds, for keys covering every partition."""
    rows = [(f"key-{i}", i) for i in range(40 * partitions)]
    df = spark.createDataFrame(rows, "k string, ts long")
    routed = route(df, key="k", partitions=partitions, order_by=["ts"], tasks=tasks)
    got = routed.select(PARTITION_COLUMN, F.spark_partition_id().alias("task")).collect()
    layout: dict[int, set[int]] = defaultdict(set)
    for r in got:
        layout[r["task"]].add(r[PARTITION_COLUMN])
    return layout


@pytest.mark.parametrize(("partitions", "tasks"), [(16, 2), (4, 2), (16, 3), (5, 4), (3, 3)])
def test_each_task_holds_an_equal_share_of_whole_partitions(spark, partitions, tasks):
    layout = _layout(spark, partitions, tasks)
    held = sorted(p for ps in layout.values() for p in ps)
    assert held == list(range(partitions)), f"a NATS partition in two tasks or none: {layout}"
    sizes = sorted((len(ps) for ps in layout.values()), reverse=True)
    want = sorted(
        (partitions // tasks + (1 if t < partitions % tasks else 0) for t in range(tasks)),
        reverse=True,
    )
    assert sizes == want, f"NATS partitions per task {sizes}, want {want}: {dict(layout)}"
    assert all(p % tasks == t for t, ps in layout.items() for p in ps), dict(layout)


def test_tasks_below_one_is_refused_naming_the_argument(spark):
    df = spark.createDataFrame([("a", 1)], "k string, ts long")
    with pytest.raises(ConfigError, match="tasks must be >= 1, got 0"):
        route(df, key="k", partitions=4, tasks=0)
