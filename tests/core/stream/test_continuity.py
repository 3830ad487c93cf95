"""The continuity check on plain values, the commit record's msg-id, and the fenced sink's
applied position (with the msg-id of the message a worker is delivering)."""

from __future__ import annotations

from airflow_nats_ordered.core.group.commits import CommitRecord
from airflow_nats_ordered.core.sink.fenced import FencedSqliteSink
from airflow_nats_ordered.core.stream.continuity import (
    AtSeq,
    Position,
    delivered_id,
    delivering,
    divergence,
    stopped_reason,
)

SUBJ = "orders.p.2"


def _pos(seq, msg_id="id-20"):
    return Position(seq, msg_id, "the group's commit record c.2")


def test_a_position_still_in_the_stream_passes():
    assert divergence(_pos(20), SUBJ, AtSeq(25, SUBJ, "id-20")) is None
    assert divergence(_pos(0), SUBJ, AtSeq(0)) is None  # nothing handled yet


def test_a_position_above_the_streams_end_went_back():
    why = divergence(_pos(20), SUBJ, AtSeq(15))
    assert why == "the group's commit record c.2 is at seq 20, above the stream's last sequence 15"
    assert divergence(_pos(20, None), SUBJ, AtSeq(15)) is not None  # without a msg-id too


def test_another_message_at_the_position_went_back():
    why = divergence(_pos(20), SUBJ, AtSeq(25, SUBJ, "id-new"))
    assert "(message 'id-20'), but the stream now holds message 'id-new' there" in why
    why = divergence(_pos(20), SUBJ, AtSeq(25, "orders.p.0", "id-x"))
    assert "holds a message of orders.p.0 there, not of orders.p.2" in why


def test_what_cannot_be_compared_passes():
    assert divergence(_pos(20), SUBJ, AtSeq(25)) is None  # deleted, aged out, purged
    # known by its sequence only (an old record, a reset to just before the first message)
    assert divergence(_pos(20, None), SUBJ, AtSeq(25, "orders.p.0", "id-x")) is None


def test_the_stopped_reason_names_the_operator_action():
    text = stopped_reason("ORDERS", "g", 2, "why", 10, 25)
    assert text.startswith("stopped: the stream's stored state went back: why.")
    assert "FencedSqliteSink.rewind({2: 10})" in text
    assert "reset_group(nc, 'ORDERS', 'g', to={2: 10}, confirm=True)" in text
    unknown = stopped_reason("ORDERS", "g", 2, "why", None, 25)
    assert "(at most 25)" in unknown and "to={2: N}" in unknown


def test_commit_records_carry_the_msg_id_and_old_ones_stay_readable():
    old = CommitRecord.from_json(b'{"seq": 5, "token": 7, "member": "m", "ts": 1.0}')
    assert (old.seq, old.token, old.msg_id, old.stream) == (5, 7, "", "")
    new = CommitRecord.from_json(b'{"seq": 5, "token": 7, "member": "m", "ts": 1, "id": "x"}')
    assert new.msg_id == "x"


def test_the_sink_reports_its_applied_position_with_the_delivered_msg_id(tmp_path):
    with FencedSqliteSink(tmp_path / "s.db", stream="S", group="g") as sink:
        assert sink.applied_position(0) is None
        sink.apply(0, 1, 3, msg_id="given")
        assert sink.applied_position(0) == (3, "given")
        sink.apply(0, 1, 4)  # no msg_id, outside a worker: unknown
        assert sink.applied_position(0) == (4, None)
        token = delivering.set({(0, 5): "delivered-5", (1, 6): "other"})
        try:
            assert delivered_id(0, 5) == "delivered-5" and delivered_id(0, 6) is None
            sink.apply(0, 1, 5)  # the handler gives no msg_id: the delivered one is kept
        finally:
            delivering.reset(token)
        assert sink.applied_position(0) == (5, "delivered-5")
        assert delivered_id(0, 5) is None
