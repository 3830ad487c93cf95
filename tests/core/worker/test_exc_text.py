"""Log lines name the exception even when its message is empty (a loaded run logged
``claiming partition 48 failed:`` and ``leader loop:`` with nothing after the colon)."""

from __future__ import annotations

import asyncio
import logging

from airflow_nats_ordered.core.errors import exc_text
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.presence import GroupWatch


def test_an_exception_without_a_message_is_named_by_its_type():
    assert exc_text(TimeoutError()) == "TimeoutError"
    assert exc_text(ValueError("  ")) == "ValueError"
    assert exc_text(ValueError("bad key")) == "ValueError: bad key"


def test_a_group_loops_warning_names_the_exception(caplog):
    # a worker's watch, without the worker: no connection, and no presence recorded (so no
    # presence check: only the warning)
    watch = GroupWatch(MemberContext(None, WorkerConfig("S", "g", member_id="m-1")), lambda: None)

    async def fail() -> None:  # the loops call it on the running loop
        watch.trouble("claiming partition %d failed", TimeoutError(), 48)

    with caplog.at_level(logging.WARNING):
        asyncio.run(fail())
    assert "member m-1: claiming partition 48 failed: TimeoutError" in caplog.text, caplog.text
