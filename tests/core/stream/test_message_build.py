"""The worker's fast way of building the handler's Message (issue 33) gives the same object as
the dataclass's own constructor: the same type, fields, equality, repr and frozenness."""

from __future__ import annotations

import dataclasses

import pytest

from airflow_nats_ordered.core.stream.message import Message, MessageSlots, new_message

ARGS = ("k-1", b"payload", {"Nats-Msg-Id": "abc", "Nats-Ordered-Seq": "7"}, 3, 42, 9, "S.3")


def test_new_message_is_the_dataclass_message():
    built, reference = new_message(*ARGS), Message(*ARGS)
    assert type(built) is Message
    assert built == reference and repr(built) == repr(reference)
    assert dataclasses.astuple(built) == dataclasses.astuple(reference)
    assert built.producer_seq == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.key = "other"  # type: ignore[misc]


def test_the_builder_has_the_message_layout():
    assert MessageSlots.__slots__ == Message.__slots__
    assert [f.name for f in dataclasses.fields(Message)] == list(Message.__slots__)
