"""The ordered publisher's settings (:class:`PublisherConfig`, Kafka's producer configs by
their Kafka names) and :func:`check_producer_id`, the rule a run's name must follow.

Guarantees: a config that is built is valid (every bound checked when it is made, each
error naming the setting), and a producer id that is accepted can name a run (non-blank,
one header line), so no publish finds either wrong half-way.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.msg_ids import _check_header_value
from airflow_nats_ordered.core.publish.sequence import StreamSequence

_FLOW_MAX = 500  # the server never acknowledges less often than every 500 messages
_MAX_BACKOFF = 1.0  # seconds between resends of a failing partition, at most


def check_producer_id(
    producer_id: str,
    name: str = "producer_id",
    left_out: str = "a new unique id per publisher",
) -> str:
    """``producer_id`` if it can name a run: a non-blank string without line breaks; else
    ConfigError naming ``name`` (the parameter, flag or option in the caller's terms) and
    saying what leaving it out gives (``left_out``).

    An empty or blank id is refused rather than read as "none given": it is what an unset
    variable (``"$RUN_ID"``, a template that rendered empty) gives, and each such publish
    would then get a new unique id and store everything again."""
    if not isinstance(producer_id, str) or not producer_id.strip():
        raise ConfigError(
            f"{name} is empty ({producer_id!r}): name the logical run with a stable, non-blank "
            "id (e.g. '<dag>.<task>.<logical date>'; an unset variable gives an empty one), so "
            f"that a rerun stores nothing twice; or leave {name} out ({left_out})"
        )
    _check_header_value(name, producer_id)
    return producer_id


@dataclass(frozen=True)
class PublisherConfig:
    """Knobs of the ordered publisher (Kafka names in brackets).

    ``max_in_flight`` [max.in.flight]: records of one partition sent but not yet
    acknowledged; the server is asked to acknowledge every ``max_in_flight // 2`` records.
    ``batch_size`` [batch.size, in records]: records per server batch before it is committed.
    ``linger`` [linger.ms, seconds]: idle time after which an open batch is committed.
    ``max_pending`` [buffer.memory, in records]: records held in all (queued + unacked).
    The default, 4,000, is a few times what the server lets one stream have in flight
    (about 1,000 records: a flow of 500 over its open batches, two flows per batch); a
    larger bound only queues records longer, until they are out of the CPU's cache when
    sent (16 partitions: 0.3-0.4 us more client CPU per record at 50,000,
    ``docs/benchmarks-publisher.md``).
    ``max_pending_bytes`` [buffer.memory]: payload bytes held in all (queued + unacked);
    a record larger than this is still accepted when nothing else is held, so a publisher
    always makes progress.
    ``max_open_batches``: server batches this publisher keeps open at once (one per
    partition that is sending). The server allows 1,000 per stream, shared by every
    publisher, and counts an abandoned batch for 10 s; beyond that it answers "too many
    batches in flight" (err 10211), which is retried with backoff.
    ``ack_timeout`` [request.timeout.ms]: wait for an acknowledgement before resending.
    ``delivery_timeout`` [delivery.timeout.ms]: how long a partition keeps retrying before
    its remaining records are reported as failed.
    ``producer_id``: mixed into derived msg-ids and sent as a header; give each logical run a
    stable id (the Airflow run id, say) so a rerun de-duplicates but a new run does not.
    Left out (``None``), each publisher gets a unique one (``OrderedPublisher.producer_id``),
    so records of unrelated publishers never share a msg-id. An empty or blank string is
    refused (ConfigError): it is what an unset variable gives, and taking it for "no id"
    would publish a rerun again instead of de-duplicating it.

    ``global_order``: a sequence over the whole stream to stamp every record with
    (:class:`~.sequence.StreamSequence`): global order's ``GlobalOrder()``
    (:mod:`..order.watermarks`) stamps ``Nats-Global-Seq`` (publish order over the whole
    stream) and writes per-partition watermarks every ``watermark_interval`` seconds, for
    :class:`~..order.reader.GlobalOrderReader`. One such publisher per stream at a time
    (see ``docs/architecture/order.md``, *Global order*).

    The stream's ``duplicate_window`` must cover :attr:`longest_resend`, the longest time
    after its first send that a record can be sent again; :meth:`OrderedPublisher.start`
    refuses a stream whose window is shorter.
    """

    max_in_flight: int = 1000
    batch_size: int = 20_000
    linger: float = 0.05
    max_pending: int = 4_000
    max_pending_bytes: int = 64 * 1024 * 1024
    max_open_batches: int = 256
    ack_timeout: float = 5.0
    delivery_timeout: float = 120.0
    producer_id: str | None = None
    allow_keyless: bool = False
    global_order: StreamSequence | None = None
    watermark_interval: float = 0.2

    def __post_init__(self) -> None:
        for name in (
            "max_in_flight",
            "batch_size",
            "max_pending",
            "max_pending_bytes",
            "max_open_batches",
        ):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("ack_timeout", "delivery_timeout", "watermark_interval"):
            if float(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.global_order is not None and not hasattr(self.global_order, "open"):
            raise ConfigError(
                f"global_order takes the sequence to stamp, not {self.global_order!r}: pass "
                "global_order=GlobalOrder() (global order's, from the core's order/watermarks.py"
                "), or leave it out"
            )
        if self.linger < 0:
            raise ConfigError(f"linger must be >= 0 seconds, got {self.linger!r}")
        if self.producer_id is not None:
            check_producer_id(self.producer_id)

    @property
    def flow(self) -> int:
        return max(1, min(_FLOW_MAX, self.max_in_flight // 2))

    @property
    def longest_resend(self) -> float:
        """Seconds after its first send that a record may still be resent: a failure is
        noticed within ``ack_timeout``, then resends go on for ``delivery_timeout``, the
        last one after at most one backoff."""
        return self.delivery_timeout + self.ack_timeout + _MAX_BACKOFF
