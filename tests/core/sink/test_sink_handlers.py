"""Handlers with a fenced sink: the loader scopes them to the worker's (stream, group) and
exposes their token floor (``fencing_floor``) next to on_assign/on_revoke/close."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from locations import ROOT

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.members.handlers import load_handler

# the flights handler as the pool loads it: the dags folder on the path (PYTHONPATH=dags)
DAGS = ROOT / "dags"
if str(DAGS) not in sys.path:
    sys.path.insert(0, str(DAGS))
EXAMPLE = "flights.handlers:AircraftTotals"


def test_loader_scopes_the_example_sink_to_the_workers_stream_and_group(tmp_path, monkeypatch):
    db = tmp_path / "totals.db"
    monkeypatch.setenv("AIRCRAFT_TOTALS_DB", str(db))
    a = load_handler(EXAMPLE, stream="FLIGHTS", group="g1")
    b = load_handler(EXAMPLE, stream="FLIGHTS", group="g2")
    try:
        assert (a.handler.sink.stream, a.handler.sink.group) == ("FLIGHTS", "g1")
        with FencedSqliteSink(db, stream="FLIGHTS", group="g1") as sink:
            sink.fence(3, 11)
        assert asyncio.run(a.fencing_floor(3)) == 11  # the floor read before each grant
        assert asyncio.run(b.fencing_floor(3)) == 0  # another group's tokens are not its floor
        assert a.close is not None and a.on_assign is not None
    finally:
        a.close()
        b.close()


def test_loader_exposes_the_chaos_recorders_fencing_floor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CHAOS_SINK", str(tmp_path / "sink.db"))
    loaded = load_handler("chaos_handlers:Recorder", stream="S", group="chaos")
    try:
        loaded.handler.sink.apply(0, 6, 1)
        assert asyncio.run(loaded.fencing_floor(0)) == 6
    finally:
        loaded.close()


def test_a_handler_class_that_needs_a_scope_is_refused_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRCRAFT_TOTALS_DB", str(tmp_path / "totals.db"))
    with pytest.raises(ConfigError, match="takes stream and group .* pass stream=..., group="):
        load_handler(EXAMPLE)
    with pytest.raises(ConfigError, match="no group was given: pass group=..."):
        load_handler(EXAMPLE, stream="FLIGHTS")


def test_handlers_without_a_sink_load_as_before() -> None:
    loaded = load_handler("chaos_handlers:StuckClose", stream="S", group="g")
    assert loaded.fencing_floor is None and loaded.on_assign is None
    assert callable(loaded.handler) and loaded.close is not None
