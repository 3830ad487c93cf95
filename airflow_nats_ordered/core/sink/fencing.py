"""The fencing rule a sink applies to every write (pure, no I/O).

Each partition's sink keeps a :class:`FenceState`: the highest fencing token it has seen and
the last message sequence it applied. A write ``(token, seq)`` is applied only if

    ``token >= highest_token`` and ``seq > last_seq``

A write with ``seq <= last_seq`` (and a valid token) is a :attr:`Verdict.DUPLICATE` only if it
is a re-delivery of the message the sink applied under that sequence; one that was never
applied (a gap or reorder upstream) or that is a different message under a re-used sequence
(a re-created stream) is :attr:`Verdict.OUT_OF_ORDER`, an error: skipping it silently would
lose it.

Guarantees, for any interleaving of writers with any tokens:

* accepted writes have non-decreasing tokens and strictly increasing sequences, so no
  message is applied twice and none is applied out of order;
* once a new owner has called :func:`raise_fence` with token ``T`` (before processing),
  no write with a token below ``T`` is ever accepted - a paused or partitioned old owner
  cannot overwrite the new owner's results ("zombie" writes);
* the fence never goes down: raising it to a lower token changes nothing;
* a sequence at or below ``last_seq`` is never silently skipped unless the sink knows it
  applied that very message (or no longer remembers it, see :func:`judge`).

The new owner resumes at its committed position: messages it re-reads that were already
applied by the previous owner are judged :attr:`Verdict.DUPLICATE` and only acknowledged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class FenceState:
    """What a sink remembers per partition: highest token seen, last sequence applied."""

    highest_token: int = 0
    last_seq: int = 0

    def __post_init__(self) -> None:
        _check_int("highest_token", self.highest_token, 0)
        _check_int("last_seq", self.last_seq, 0)


class Verdict(enum.Enum):
    """The outcome of judging one write."""

    #: Apply the write, then :func:`advance` the state.
    APPLY = "APPLY"
    #: The writer's token is below the fence: it is no longer the owner; it must stop.
    STALE_TOKEN = "STALE_TOKEN"
    #: The sequence is not newer than the last applied one: already applied; just ack it.
    DUPLICATE = "DUPLICATE"
    #: The sequence is not newer than the last applied one but this message was never
    #: applied under it (a gap or reorder upstream, or a re-created stream): an error.
    OUT_OF_ORDER = "OUT_OF_ORDER"


def judge(state: FenceState, token: int, seq: int, *, applied: bool | None = None) -> Verdict:
    """The verdict on writing message ``seq`` under fencing ``token``.

    ``applied`` is what the sink knows of a ``seq <= last_seq``: True if it applied this same
    message under ``seq`` (a re-delivery: DUPLICATE), False if it did not (OUT_OF_ORDER),
    None if it no longer remembers that sequence (counted as a re-delivery). It is ignored
    for a newer ``seq``.

    ``STALE_TOKEN`` wins over the others: a fenced-off writer is told it is fenced even
    for a message that was already applied. ``token`` must be >= 0 and ``seq`` >= 1
    (JetStream sequences start at 1; a seq of 0 could never be applied).
    """
    _check_int("token", token, 0)
    _check_int("seq", seq, 1)
    if token < state.highest_token:
        return Verdict.STALE_TOKEN
    if seq > state.last_seq:
        return Verdict.APPLY
    return Verdict.OUT_OF_ORDER if applied is False else Verdict.DUPLICATE


def advance(state: FenceState, token: int, seq: int) -> FenceState:
    """The state after applying ``(token, seq)``; raises ValueError unless judged APPLY."""
    verdict = judge(state, token, seq)
    if verdict is not Verdict.APPLY:
        raise ValueError(
            f"cannot advance the fence with token={token}, seq={seq}: the write is "
            f"{verdict.name} against {state}; only advance after judge() returned APPLY"
        )
    return FenceState(highest_token=token, last_seq=seq)


def raise_fence(state: FenceState, token: int) -> FenceState:
    """The state after a new owner announces ``token``; never lowers the fence."""
    _check_int("token", token, 0)
    if token <= state.highest_token:
        return state
    return FenceState(highest_token=token, last_seq=state.last_seq)
