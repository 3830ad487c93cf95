"""What the driver checks on the stream when a writer is created, before the run is begun in
the ledger and before any task sends a row.

* The stream's ``duplicate_window`` must cover the longest time a task's publisher may
  resend a record (option ``deliveryTimeout``, 120 s by default, plus the acknowledgement
  timeout and the resend backoff): a later resend would be stored twice. The publisher
  refuses such a stream when it starts, which is in every task, after the ledger said
  ``running``; the writer refuses it first, naming the Spark option to change.
* The stream's last sequence when the write starts: what a run stored is the sequences
  after it (:func:`~.runs.record_run` counts duplicates of unrouted rows from it, as the
  tasks cannot: they share NATS partitions).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.config import _MAX_BACKOFF, PublisherConfig
from airflow_nats_ordered.core.stream.partitioned import describe

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from airflow_nats_ordered.spark.options import SinkOptions


def publisher_config(options: SinkOptions, producer_id: str) -> PublisherConfig:
    """The tasks' publisher settings for ``options``."""
    if options.delivery_timeout is None:
        return PublisherConfig(producer_id=producer_id)
    return PublisherConfig(producer_id=producer_id, delivery_timeout=options.delivery_timeout)


async def check_resend_window(nc: NATS, options: SinkOptions) -> None:
    """Raise ConfigError, naming ``deliveryTimeout`` and the stream's window, when a task could
    resend a record after the stream stopped de-duplicating its msg-id."""
    ps = await describe(nc, options.stream)
    cfg = publisher_config(options, "preflight")
    window, longest = ps.duplicate_window, cfg.longest_resend
    if window >= longest:
        return
    most = window - cfg.ack_timeout - _MAX_BACKOFF
    given = (
        f"option deliveryTimeout is {cfg.delivery_timeout:g}s"
        if options.delivery_timeout is not None
        else f"option deliveryTimeout is not set (default {cfg.delivery_timeout:g}s)"
    )
    lower = (
        f'lower it: .option("deliveryTimeout", "{math.floor(most)}") or less, or '
        if most >= 1
        else ""
    )
    raise ConfigError(
        f"{given}, so a task may resend a record up to {longest:g}s after sending it "
        f"(+ ack timeout {cfg.ack_timeout:g}s + backoff {_MAX_BACKOFF:g}s), but stream "
        f"{ps.name} de-duplicates msg-ids for {window:g}s only (its duplicate_window): a "
        f"late resend would be stored twice. Nothing was sent and the run was not begun; "
        f"{lower}raise the stream's window: `nats-ordered provision --stream {ps.name} "
        f"--partitions {ps.partitions} --duplicate-window {math.ceil(longest)}s`"
    )


async def last_seq(nc: NATS, stream: str) -> int:
    """The stream's last sequence (0 when empty): every message stored later is above it."""
    ps = await describe(nc, stream)
    info = await jetstream(nc).stream_info(ps.name)
    return int(info.state.last_seq or 0)
