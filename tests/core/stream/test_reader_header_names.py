"""The reader checks each distinct header name once (issue 19 item 2, third pass).

:func:`parse_headers` remembers what nats-py makes of the text before a line's first colon
(the name trimmed, or the line skipped), so a name is not trimmed and scanned for blanks
again in every message. What it remembers must never change a result: the same blocks
parse exactly as nats-py parses them, in any order, whatever was seen before, and after
the memory is cleared (it is bounded)."""

from __future__ import annotations

from nats.aio.client import Client

from airflow_nats_ordered.core.stream import reader
from airflow_nats_ordered.core.stream.reader import parse_headers

BLOCKS = [
    b"Nats-Msg-Id: a\r\nNats-Ordered-Key: k\r\n",
    b": empty name\r\n",  # nats-py keeps the empty name
    b" : blank name\r\n",
    b"Nats-Msg-Id : b\r\n",  # the same name with a blank before the colon
    b"\tNats-Msg-Id: c\r\n",
    b"Nats Msg: skipped\r\nNats-Msg-Id:d\r\n",  # a blank inside: skipped
    b"Na\xc3\xa9me: non-ASCII name, skipped\r\nX: 1\r\n",
    b"X: 1\r\nX: 2\r\nx: 3\r\n",  # the last of a repeated name wins; names are case-sensitive
    b"Y:  spaced value \t\r\nZ:\r\n",
    b"K: v\n\r\n",  # a lone line feed ends the last value
    b"no colon\r\nK: a:b:c\r\n",
]


def _nats_py(raw: bytes) -> dict[str, str]:
    return Client._parse_header_lines(raw[len(b"NATS/1.0\r\n") :])


def test_each_block_parses_as_nats_py_whatever_was_parsed_before():
    blocks = [b"NATS/1.0\r\n" + b + b"\r\n" for b in BLOCKS]
    for order in (blocks, blocks[::-1], blocks + blocks):
        for raw in order:
            assert parse_headers(raw) == _nats_py(raw), raw


def test_names_beyond_the_bound_still_parse_as_nats_py():
    raws = [b"NATS/1.0\r\nName-%d: %d\r\n Name-%d : x\r\n\r\n" % (i, i, i) for i in range(5000)]
    for raw in raws + raws[:10]:
        assert parse_headers(raw) == _nats_py(raw), raw
    assert len(reader._NAMES) <= reader._NAMES_MAX
