"""A worker's settings (:class:`WorkerConfig`): one home for the CLI, Airflow adapters and tests.

A :class:`WorkerConfig` that exists is valid: its poison policy, batch sizes, buffer bound,
retries and member id are checked on creation, and its group settings (group name, lease
TTL, replicas, ``missing_commit``) through :attr:`WorkerConfig.group_config`, each with a
:class:`~..errors.ConfigError` naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.config import (
    GroupConfig,
    MissingCommitPolicy,
    default_member_id,
)

#: the longest wait between two attempts of something that keeps failing (a claim whose
#: on_assign or grant fails, a dead-letter publish)
BACKOFF_MAX = 10.0


@dataclass(frozen=True)
class WorkerConfig:
    """A member's settings; one home for the CLI, the Airflow adapters and tests."""

    stream: str
    group: str
    member_id: str = field(default_factory=default_member_id)
    lease_ttl: float = 5.0
    #: messages per pull request (two in flight per partition). 100, not 500: a synchronous
    #: handler's partition hands the event loop over at each commit point (every 100), and
    #: a larger batch's prebuilt messages go cold while the other partitions run (issue 33:
    #: -15 to -20 % client CPU per record at 100, the same server CPU; docs/benchmarks.md)
    fetch_batch: int = 100
    #: bytes of fetched, unhandled messages this member may hold, shared by the partitions
    #: it owns (each gets an equal share; half of a share per pull request's max_bytes)
    max_buffer_bytes: int = 64 * 1024 * 1024
    #: commit a partition's position every this many messages / seconds (and, with a
    #: synchronous handler, whenever the partition gives the event loop up); a write is on
    #: the wire at once, one in flight per partition, which bounds what a crash re-delivers
    #: (issue 19: 1000 / 1 s at first, then 25 / 0.1 s; see docs/benchmarks.md for the
    #: trade-off)
    commit_every: int = 100
    commit_interval: float = 0.1
    max_retries: int = 3
    retry_backoff: float = 0.2
    poison: Literal["dead-letter", "block"] = "dead-letter"
    batch_handler: bool = False
    poll_interval: float | None = None
    #: how long stop() waits for handlers to finish the message in hand before cancelling
    #: them (as a crash would: nothing committed for them)
    stop_timeout: float = 30.0
    #: append lease validity windows and assignments as JSON lines here (audits, chaos tests)
    audit_log: str | None = None
    #: replicas of the group's KV buckets; None: the stream's replica count
    state_replicas: int | None = None
    #: where a partition whose commit record disappeared resumes: "fail" (refuse it and
    #: report), "earliest" or "latest" (Kafka's auto.offset.reset)
    missing_commit: MissingCommitPolicy = "fail"

    def __post_init__(self) -> None:
        if self.poison not in ("dead-letter", "block"):
            raise ConfigError(
                f"poison policy must be 'dead-letter' or 'block', not {self.poison!r}"
            )
        if self.fetch_batch < 1 or self.commit_every < 1:
            raise ConfigError("fetch_batch and commit_every must be >= 1")
        if self.max_buffer_bytes < 1024:
            raise ConfigError(
                f"max_buffer_bytes must be >= 1024 (bytes), got {self.max_buffer_bytes!r}"
            )
        if self.max_retries < 0:
            raise ConfigError("max_retries must be >= 0")
        if not self.member_id or "." in self.member_id or " " in self.member_id:
            raise ConfigError(f"member id {self.member_id!r} must be non-empty, no dots or spaces")
        _ = self.group_config  # validates group, TTL, replicas and missing_commit

    @property
    def group_config(self) -> GroupConfig:
        return GroupConfig(
            self.stream,
            self.group,
            self.lease_ttl,
            replicas=self.state_replicas,
            missing_commit=self.missing_commit,
        )

    @property
    def tick(self) -> float:
        return self.poll_interval or min(0.1, self.lease_ttl / 10)
