"""What a publisher reports: :class:`PublishSummary` per run and partition, and
:class:`PublishError` when records were not confirmed as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_nats_ordered.core.errors import NatsOrderedError


@dataclass
class PartitionSummary:
    partition: int
    #: records passed over unsent because an earlier attempt of the same run stored their
    #: positions (``OrderedPublisher(start_after=...)``, or found stored since by its
    #: ``fence``); this attempt's records follow them
    offset: int = 0
    accepted: int = 0
    acked: int = 0
    failed: int = 0
    last_seq: int = 0
    stored: int | None = None
    duplicates: int | None = None
    retries: int = 0
    resent: int = 0
    unexpected_duplicates: int = 0
    error: str | None = None


@dataclass
class PublishSummary:
    """What a publisher did. ``last_seq`` per partition is the high-water mark a drain waits for.

    ``stored``/``duplicates`` come from the partition's message count before and after, so
    they are exact when this publisher was the only writer of its partitions meanwhile
    (another writer can hide duplicates, never invent them; if the stream's limits removed
    messages meanwhile, no duplicate is called unexpected). ``resent`` counts records sent
    more than once after a failure: the server may rightly call those duplicates.
    ``unexpected_duplicates`` are acknowledged records the server did not store because it
    already held their msg-id although this publisher sent them only once and expected
    no duplicate (no explicit ``producer_id``, no caller msg-id): they are NOT stored, and
    :meth:`OrderedPublisher.flush` raises :class:`PublishError`. A rerun with the same
    explicit ``producer_id`` expects duplicates: they are counted, not raised.
    """

    stream: str
    partitions: list[PartitionSummary]
    refused: int = 0
    elapsed: float = 0.0

    @property
    def accepted(self) -> int:
        return sum(p.accepted for p in self.partitions)

    @property
    def acked(self) -> int:
        return sum(p.acked for p in self.partitions)

    @property
    def failed(self) -> int:
        return sum(p.failed for p in self.partitions)

    @property
    def duplicates(self) -> int:
        return sum(p.duplicates or 0 for p in self.partitions)

    @property
    def unexpected_duplicates(self) -> int:
        return sum(p.unexpected_duplicates for p in self.partitions)

    @property
    def high_water_marks(self) -> dict[int, int]:
        return {p.partition: p.last_seq for p in self.partitions}

    def to_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "accepted": self.accepted,
            "acked": self.acked,
            "failed": self.failed,
            "refused": self.refused,
            "duplicates": self.duplicates,
            "unexpected_duplicates": self.unexpected_duplicates,
            "elapsed": round(self.elapsed, 3),
            "partitions": [vars(p) for p in self.partitions],
        }


class PublishError(NatsOrderedError):
    """Some records were not confirmed as stored. ``summary`` says which, per partition, in
    order: of partition p, records ``acked+1 .. accepted`` (producer sequence).

    Some of them may still have been stored (an acknowledgement lost with the connection),
    but each partition always holds a gap-free prefix of its input; republishing the same
    input inside the duplicate window completes it and stores nothing twice.

    Also raised when the server acknowledged records without storing them because their
    msg-ids were already stored by someone else (``summary.unexpected_duplicates``)."""

    def __init__(self, summary: PublishSummary, first_error: str | None) -> None:
        self.summary = summary
        self.first_error = first_error
        text = []
        if summary.failed:
            parts = [
                f"partition {p.partition}: producer seq {p.offset + p.acked + 1}.."
                f"{p.offset + p.accepted}"
                for p in summary.partitions
                if p.failed
            ]
            more = " ..." if len(parts) > 8 else ""
            text.append(
                f"{summary.failed} of {summary.accepted} records were not confirmed as stored "
                f"in stream {summary.stream} ({'; '.join(parts[:8])}{more}); first failure: "
                f"{first_error or 'unknown'}. Republishing the same input (same producer id) "
                "completes the stream without storing anything twice."
            )
        if summary.unexpected_duplicates:
            parts = [
                f"partition {p.partition}: {p.unexpected_duplicates}"
                for p in summary.partitions
                if p.unexpected_duplicates
            ]
            more = " ..." if len(parts) > 8 else ""
            text.append(
                f"{summary.unexpected_duplicates} acknowledged records were NOT stored in "
                f"stream {summary.stream} ({'; '.join(parts[:8])}{more}): the server already "
                "held their msg-ids although this publisher sent them once and expected no "
                "duplicate. Another publisher used the same producer id or msg-ids inside "
                "the stream's duplicate window; give each publisher its own producer_id "
                "(leave it unset for a unique one) and republish those records."
            )
        super().__init__(" ".join(text))


__all__ = ["PartitionSummary", "PublishError", "PublishSummary"]
