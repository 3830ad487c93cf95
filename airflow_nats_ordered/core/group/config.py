"""A consumer group's configuration (:class:`GroupConfig`) and a member's default id.

Guarantees: a :class:`GroupConfig` that exists is valid (name, lease TTL, replicas and
``missing_commit`` policy are checked on creation, with a :class:`~..errors.ConfigError`
naming the setting); its bucket names are derived from stream and group only, so every
member of a group finds the same buckets.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Literal

from airflow_nats_ordered.core.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MissingCommitPolicy = Literal["fail", "earliest", "latest"]
MISSING_COMMIT_POLICIES: tuple[str, ...] = ("fail", "earliest", "latest")


def default_member_id() -> str:
    """``<short host name>-<pid>``: unique per process, and without dots (a member id is a
    KV key token), even on a host whose name is a dotted FQDN."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


@dataclass(frozen=True)
class GroupConfig:
    """Where a group keeps its state and how long its leases live.

    ``lease_ttl`` is enforced by the server (bucket max age); ``margin`` is subtracted on
    the member's side so it stops before the server could hand the lease to someone else.
    ``replicas`` of both buckets: ``None`` takes the stream's replica count. ``missing_commit``
    decides where a partition resumes when its commit record disappeared although it had
    one (Kafka's ``auto.offset.reset``): ``fail`` refuses the partition, ``earliest``
    re-reads it from its first message still in the stream, ``latest`` skips to after its
    last message. A partition of a brand-new group starts at its beginning in every case.
    """

    stream: str
    group: str
    lease_ttl: float = 5.0
    margin: float | None = None
    replicas: int | None = None
    missing_commit: MissingCommitPolicy = "fail"

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.group or ""):
            raise ConfigError(
                f"group name {self.group!r} is not valid: 1-64 letters, digits, '_' or '-'"
            )
        if not 0.5 <= self.lease_ttl <= 3600:
            raise ConfigError(f"lease TTL must be 0.5 to 3600 seconds, got {self.lease_ttl!r}")
        if self.replicas is not None and self.replicas not in (1, 2, 3, 4, 5):
            raise ConfigError(
                f"replicas must be 1 to 5 (or None: the stream's), got {self.replicas!r}"
            )
        if self.missing_commit not in MISSING_COMMIT_POLICIES:
            raise ConfigError(
                f"missing_commit must be one of {', '.join(MISSING_COMMIT_POLICIES)}, "
                f"got {self.missing_commit!r}"
            )

    @property
    def safety_margin(self) -> float:
        return self.margin if self.margin is not None else min(1.0, self.lease_ttl * 0.2)

    @property
    def renew_interval(self) -> float:
        return self.lease_ttl / 4

    @property
    def lease_bucket(self) -> str:
        return f"nor_{self.stream}_{self.group}_leases"

    @property
    def state_bucket(self) -> str:
        return f"nor_{self.stream}_{self.group}_state"

    def jetstream_names(self, *also: str) -> tuple[str, ...]:
        """The JetStream objects a member of this group uses, as they appear in API, KV and
        acknowledgement subjects: the stream, its dead-letter stream, the group's buckets
        and their ``KV_`` streams (plus ``also``): what tells a refused permission of the
        member's own from another's on a shared connection (``denials.concerns``)."""
        buckets = (self.lease_bucket, self.state_bucket, *also)
        return (
            self.stream,
            f"{self.stream}_DLQ",
            *buckets,
            *(f"KV_{b}" for b in buckets),
        )
