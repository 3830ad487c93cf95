"""``records.record_rest_id`` (the frame rest and its derived msg-id handed back, for
``OrderedPublisher.publish_placed``): both twins, compiled and pure, give the frame
``record_rest`` gives and append the msg-id of ``docs/protocol.md`` section 6, on the
protocol page's golden vectors and on awkward records (sizes around BLAKE2b's 128-byte
blocks, long places, binary keys, every digit count of the frame's lengths)."""

from __future__ import annotations

import os
import random

import pytest
from protocol_page import golden_vectors

from airflow_nats_ordered.core.publish import records
from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id
from airflow_nats_ordered.core.stream import compiled
from airflow_nats_ordered.core.stream.keys import key_header_line

TWIN = "airflow_nats_ordered.core.publish._records"


@pytest.fixture(params=["pure", "compiled"])
def impl(request):
    if request.param == "pure":
        return records.rest_form_py, records.record_rest_id_py
    twin = compiled.load(TWIN)
    if twin is None:
        if os.environ.get("CI") and not compiled.disabled():
            pytest.fail(f"{TWIN} was not built under CI")
        pytest.skip(f"{TWIN} is not built here (or NATS_ORDERED_NO_EXTENSIONS is set)")
    return twin.rest_form, twin.record_rest_id


def test_the_golden_vectors_msg_ids_come_back_with_their_frames(impl):
    rest_form, record_rest_id = impl
    gv = golden_vectors()
    form = rest_form(gv["producer_id"].encode())
    pure = records.rest_form_py(gv["producer_id"].encode())
    ids: list[bytes] = []
    for rec in gv["records"]:
        kb, line = key_header_line(rec["key"]) if rec["key"] is not None else (b"", b"")
        data = rec["payload"].encode()
        got = record_rest_id(form, rec["index"], kb, line, rec["seq"], data, ids)
        assert got == records.record_rest_py(pure, rec["index"], kb, line, rec["seq"], data)
        assert ids[-1].decode() == rec["msg_id"], rec
    assert len(ids) == len(gv["records"])


def test_the_worked_example_of_section_6(impl):
    rest_form, record_rest_id = impl
    ids: list[bytes] = [b"before"]
    record_rest_id(rest_form(b"golden-run-1"), 1, b"customer-42", b"", 1, b'{"order":1}', ids)
    assert ids == [b"before", b"5efca2965d9e7fdb0722b3ff5f2110"]


@pytest.mark.parametrize("producer", [b"bench", b"run-%s-%d-%%", "r\u00e9sum\u00e9".encode(), b""])
def test_both_agree_with_the_reference_on_awkward_records(impl, producer):
    rest_form, record_rest_id = impl
    form, pure = rest_form(producer), records.rest_form_py(producer)
    rnd = random.Random(3333)
    ids: list[bytes] = []
    for i in range(400):
        kb = rnd.randbytes(rnd.choice([0, 1, 7, 127, 128, 129, 300])) if i % 5 else b""
        line = b"Nats-Ordered-Key-B64: %d\r\n" % i if kb else b""
        data = rnd.randbytes(rnd.choice([0, 1, 99, 127, 128, 129, 1000, 12345]))
        place = rnd.choice([1, 9, 10, 99, 2**40, 2**63 - 1, rnd.randrange(1, 10**9)])
        seq = rnd.choice([1, 9, 10, 10**12])
        got = record_rest_id(form, place, kb, line, seq, data, ids)
        assert got == records.record_rest_py(pure, place, kb, line, seq, data)
        assert ids[-1] == derive_msg_id(producer, place, kb, data).encode()
    assert len(ids) == 400
