"""The old layout's share of a run carried over a repartition (core/publish/run_layouts.py), with
plain values: per old partition exactly its first n records, keyed ones by their key's old
partition, keyless ones by their round-robin turn."""

from __future__ import annotations

import pytest

from airflow_nats_ordered.core.publish.run_layouts import OldLayout
from airflow_nats_ordered.core.stream.partitioning import partition_for


def test_the_old_layout_holds_the_first_n_records_of_each_old_partition_keyed_or_keyless():
    keys = [f"k{i % 9}" if i % 4 else "" for i in range(60)]
    stored = {0: 5, 1: 0, 2: 7}
    layout = OldLayout(3, stored)
    seen: dict[int, int] = {}
    turn = 0
    for key in keys:
        if key:
            p = partition_for(key, 3)
            held = layout.stored(key.encode(), 0)
        else:
            p = turn % 3
            held = layout.stored(b"", turn)
            turn += 1
        seen[p] = seen.get(p, 0) + 1
        assert held == (seen[p] <= stored.get(p, 0)), (key, p, seen[p])
    assert layout.left == 0


def test_an_old_layout_needs_a_partition():
    with pytest.raises(ValueError, match="at least 1 partition"):
        OldLayout(0, {})
