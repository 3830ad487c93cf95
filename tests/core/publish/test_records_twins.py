"""A record's wire form, compiled and pure (issue 33, goal 4): the same golden vectors run
through both implementations of :mod:`airflow_nats_ordered.core.publish.records` (the
pure-Python reference and its Cython twin ``_records``) and must give the protocol page's
msg-ids and header blocks byte for byte, and the same frames as each other on awkward
records (empty and long keys and payloads, every length around BLAKE2b's 128-byte blocks,
NUL bytes, a producer id with ``%`` and non-ASCII text). No server: quick.
"""

from __future__ import annotations

import os
import random
from collections import deque
from types import SimpleNamespace

import pytest
from protocol_page import golden_vectors

from airflow_nats_ordered.core.publish import records
from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id
from airflow_nats_ordered.core.stream import compiled
from airflow_nats_ordered.core.stream.keys import key_header_line

TWIN = "airflow_nats_ordered.core.publish._records"
PURE = SimpleNamespace(
    rest_form=records.rest_form_py,
    msg_id=records.msg_id_py,
    record_rest=records.record_rest_py,
    window_frames=records.window_frames_py,
    take_acked=records.take_acked_py,
)


@pytest.fixture(params=["pure", "compiled"])
def impl(request):
    if request.param == "pure":
        return PURE
    twin = compiled.load(TWIN)
    if twin is None:
        if os.environ.get("CI") and not compiled.disabled():
            pytest.fail(f"{TWIN} was not built under CI")
        pytest.skip(f"{TWIN} is not built here (or NATS_ORDERED_NO_EXTENSIONS is set)")
    return twin


def _key(rec):
    if rec["key"] is None:
        return b"", b""
    return key_header_line(rec["key"])


def test_the_protocol_pages_msg_ids_and_header_blocks(impl):
    gv = golden_vectors()
    form = impl.rest_form(gv["producer_id"].encode())
    for rec in gv["records"]:
        kb, line = _key(rec)
        data = rec["payload"].encode()
        assert impl.msg_id(form, rec["index"], kb, data).decode() == rec["msg_id"], rec
        rest, size, total = impl.record_rest(form, rec["index"], kb, line, rec["seq"], data)
        hdr = rec["headers"].encode()
        assert rest == b".1.$FI %d %d\r\n%s%s\r\n" % (len(hdr), len(hdr) + size, hdr, data)
        assert (size, total) == (len(data), len(hdr) + len(data))


def test_the_worked_example_of_section_6(impl):
    form = impl.rest_form(b"golden-run-1")
    got = impl.msg_id(form, 1, b"customer-42", b'{"order":1}')
    assert got == b"5efca2965d9e7fdb0722b3ff5f2110"


def _awkward(n: int = 600):
    rnd = random.Random(33)
    sizes = [0, 1, 2, 100, 110, 126, 127, 128, 129, 255, 256, 257, 1000, 4096]
    for i in range(n):
        kb = rnd.randbytes(rnd.choice([0, 1, 7, 64, 127, 128, 129, 300])) if i % 5 else b""
        line = b"Nats-Ordered-Key-B64: %d\r\n" % i if kb else b""
        data = rnd.randbytes(rnd.choice(sizes)) if i % 7 else b"\x00" * (i % 300)
        place = rnd.choice([1, 9, 10, 99, 12345, 2**40, 2**63 - 1, rnd.randrange(1, 10**9)])
        yield place, kb, line, rnd.randrange(1, 10**12), data


@pytest.mark.parametrize(
    "producer", [b"bench", b"run-%s-%d-%%", "r\u00e9sum\u00e9-\u20ac".encode(), b""]
)
def test_both_agree_with_the_reference_derivation_on_awkward_records(impl, producer):
    form, pure = impl.rest_form(producer), PURE.rest_form(producer)
    for place, kb, line, seq, data in _awkward():
        mid = impl.msg_id(form, place, kb, data)
        assert mid == derive_msg_id(producer, place, kb, data).encode()
        got = impl.record_rest(form, place, kb, line, seq, data)
        assert got == PURE.record_rest(pure, place, kb, line, seq, data)
        rest = got[0]
        assert rest.endswith(b"\r\n") and rest[-2 - len(data) : -2] == data
        assert b"Nats-Msg-Id: %s\r\n%sNats-Ordered-Seq: %d\r\n" % (mid, line, seq) in rest


def test_window_frames_move_records_and_number_them_from_the_batch_seq(impl):
    form = PURE.rest_form(b"p")
    recs = [
        PURE.record_rest(form, i, b"k%d" % i, b"", i, b"x" * (i * 37 % 500)) for i in range(1, 60)
    ]
    head = b"HPUB orders.p.3 _INBOX.abcdefghijkl.3.abcdefghijklp3b2.500.fail."
    queue, inflight, frames = deque(recs), deque([recs[0]]), [b"before"]
    got = impl.window_frames(head, 998, queue, inflight, 50, frames)
    assert frames == [b"before"] + [
        b"%s%d%s" % (head, 999 + i, r[0]) for i, r in enumerate(recs[:50])
    ]
    assert list(queue) == recs[50:] and list(inflight) == [recs[0]] + recs[:50]
    assert got == (sum(r[1] for r in recs[:50]), max(r[2] for r in recs[:50]))
    assert impl.window_frames(head, 0, deque(), deque(), 0, []) == (0, 0)


def test_take_acked_drops_the_acknowledged_head_and_counts_its_payload(impl):
    recs = [(b"r%d" % i, i * 3, i * 3 + 40) for i in range(20)]
    inflight = deque(recs)
    assert impl.take_acked(inflight, 7) == sum(r[1] for r in recs[:7])
    assert list(inflight) == recs[7:]
    assert impl.take_acked(inflight, 0) == 0 and len(inflight) == 13


def test_the_module_uses_the_twin_where_it_was_built():
    twin = compiled.load(TWIN)
    assert (twin is not None) == records.COMPILED
    if twin is not None:
        assert records.record_rest is twin.record_rest
        assert records.window_frames is twin.window_frames
        assert records.take_acked is twin.take_acked
