"""A producer's event time, read from a header, for the global-order reader's event-time
mode (``GlobalOrderReader(..., order_by="event-time", time_header=...)``): pure, no I/O.

The header's value is one of two forms (``docs/protocol.md`` section 12.1):

* an integer number of **milliseconds** since the Unix epoch (Kafka's record timestamp,
  JavaScript's ``Date.now()``): ASCII digits, no sign, e.g. ``1795637069123``;
* an **RFC 3339** timestamp with a time zone (``Z`` or ``±hh:mm``) and up to nine fraction
  digits, e.g. ``2026-11-25T20:04:29.123456789Z`` (nanoseconds: the finer form).

Guarantee: :func:`parse_event_time` returns nanoseconds since the epoch for exactly these
forms (leading and trailing blanks ignored: NATS clients trim header values) and raises
:class:`ValueError` saying what is wrong with anything else; it never guesses a unit.
:class:`EventTimeError` is what stops a reader at a record without a usable time.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from airflow_nats_ordered.core.errors import NatsOrderedError

#: the header the event-time mode reads unless told another (``time_header``)
DEFAULT_TIME_HEADER = "Nats-Ordered-Event-Time"

_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

FORMS = "integer Unix epoch milliseconds (e.g. 1795637069123) or RFC 3339 with a time zone "
FORMS += "(e.g. 2026-11-25T20:04:29.123Z)"


class EventTimeError(NatsOrderedError):
    """A record whose time header is missing or not a time, in the event-time mode with
    ``late`` other than ``"dead-letter"``: the reader stopped before it."""

    def __init__(self, message: str, partition: int, seq: int, header: str, why: str) -> None:
        super().__init__(message)
        self.partition = partition
        self.seq = seq
        self.header = header
        self.why = why


def parse_event_time(value: str | None) -> int:
    """The event time in ``value`` as nanoseconds since the Unix epoch; ValueError (the
    reason, without the header's name) if it is missing or in neither form."""
    if value is None:
        raise ValueError("the header is missing")
    text = value.strip()
    if not text:
        raise ValueError("the header is empty")
    if text.isascii() and text.isdigit():
        return int(text) * 1_000_000
    m = _RFC3339.fullmatch(text)
    if m is None:
        raise ValueError(f"{value[:64]!r} is not a time: expected {FORMS}")
    year, month, day, hour, minute, second = (int(x) for x in m.groups()[:6])
    frac, zulu, sign, oh, om = m.group(7), m.group(8), m.group(9), m.group(10), m.group(11)
    try:
        when = datetime(year, month, day, hour, minute, min(second, 59), tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"{value[:64]!r} is not a valid date or time ({exc})") from None
    if not zulu:
        offset = timedelta(hours=int(oh), minutes=int(om))
        when -= offset if sign == "+" else -offset
    seconds = (when - _EPOCH) // timedelta(seconds=1) + (1 if second == 60 else 0)  # leap
    return seconds * 1_000_000_000 + int((frac or "").ljust(9, "0"))


__all__ = ["DEFAULT_TIME_HEADER", "FORMS", "EventTimeError", "parse_event_time"]
