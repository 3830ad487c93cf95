"""Is a recorded position still part of the stream's history? (pure, no I/O)

A group's committed position (``c.<n>``), the sink's applied position and the reader's
position are stream sequences, each of one particular message. If the servers' stored
state goes back (a store restored from an older copy, or writes lost inside the fsync
interval of every replica at once), the stream's sequences are handed out again to new
records: a position recorded before the loss then points past the stream's end, or at a
different message. Resuming from it would skip the new records that took its sequences
(or have a fenced sink refuse them, or take them for re-deliveries).

:func:`divergence` compares a :class:`Position` (sequence and, when known, the
``Nats-Msg-Id`` of the message at it) with what the stream holds there (:class:`AtSeq`)
and says why it is not part of the stream's history any more, or None when it may be:

* the sequence is above the stream's last sequence;
* (a position with a msg-id) the stream holds a message of another partition at it, or
  one with another ``Nats-Msg-Id`` (or none).

A message no longer stored (deleted, aged out, purged) cannot be compared and passes; a
position without a msg-id (an old commit record, a reset, a sink given no ``msg_id``
outside a worker, a record published without one) is checked by its sequence only.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """A recorded position: the stream sequence of the last message handled, the
    ``Nats-Msg-Id`` of that message if known, and whose position it is (for messages)."""

    seq: int
    msg_id: str | None
    source: str


@dataclass(frozen=True)
class AtSeq:
    """What the stream holds at a position's sequence: its last sequence now, and the
    subject and ``Nats-Msg-Id`` of the message stored at the sequence (``subject`` None:
    no message is stored there)."""

    last_seq: int
    subject: str | None = None
    msg_id: str | None = None


def divergence(position: Position, subject: str, found: AtSeq) -> str | None:
    """Why ``position`` (of the partition whose subject is ``subject``) is not part of the
    stream's history any more, or None if it may be."""
    seq, source = position.seq, position.source
    if seq <= 0:
        return None
    if seq > found.last_seq:
        return f"{source} is at seq {seq}, above the stream's last sequence {found.last_seq}"
    if found.subject is None or not position.msg_id:
        # no longer stored, or a position known by its sequence only (a reset to
        # "earliest" may point just before the partition's first message, at another
        # partition's): nothing to compare
        return None
    if found.subject != subject:
        return (
            f"{source} is at seq {seq}, but the stream now holds a message of {found.subject} "
            f"there, not of {subject}"
        )
    if found.msg_id != position.msg_id:
        return (
            f"{source} is at seq {seq} (message {position.msg_id!r}), but the stream now holds "
            f"message {found.msg_id!r} there"
        )
    return None


def stopped_reason(
    stream: str, group: str, partition: int, problem: str, anchor: int | None, last_seq: int
) -> str:
    """The blocked marker of a partition stopped for ``problem``: what happened, what the
    member does, and the operator action. ``anchor`` is a position known to be in the
    stream's history (the group's verified committed position), if there is one."""
    if anchor is not None:
        where = f"seq {anchor} (the group's committed position, still in the stream)"
        seq = str(anchor)
    else:
        where = (
            f"the last sequence of partition {partition} (at most {last_seq}) that the sink "
            "applied and that the stream still holds with the same Nats-Msg-Id"
        )
        seq = "N"
    return (
        f"stopped: the stream's stored state went back: {problem}. The servers lost writes "
        "(a store restored from an older copy, or a power loss inside the fsync interval) "
        "and new records reuse the lost sequences, so resuming would skip them or have the "
        "sink refuse them; nothing of partition "
        f"{partition} is handled or committed until an operator resets it. Operator action "
        f"(as for Kafka's offset-out-of-range): pick {where}; rewind the sink there "
        f"(FencedSqliteSink.rewind({{{partition}: {seq}}}), undoing the effects of what it "
        f"applied after it if they must go), then reset the group there (reset_group(nc, "
        f"{stream!r}, {group!r}, to={{{partition}: {seq}}}, confirm=True), or "
        "NatsResetGroupOperator); processing resumes with the first record after it"
    )


#: The messages a worker is handing to its handler right now: ``{(partition, stream seq):
#: Nats-Msg-Id}``. A sink the handler calls without a ``msg_id`` (the FencedSqliteSink)
#: records the message's id from here, so its applied position can be checked against the
#: stream later even when the handler does not pass ``msg_id``. Context-local: it follows
#: the handler into ``asyncio.to_thread`` and tasks it awaits, and is empty elsewhere.
delivering: ContextVar[Mapping[tuple[int, int], str] | None] = ContextVar(
    "nats_ordered_delivering", default=None
)


def delivered_id(partition: int, seq: int) -> str | None:
    """The Nats-Msg-Id of message ``seq`` of ``partition`` if the worker is delivering it
    in this context (see :data:`delivering`), else None."""
    current = delivering.get()
    return current.get((partition, seq)) if current else None
