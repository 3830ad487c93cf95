"""The reader's hot loop has two twins (issue 33, goal 4): the same golden vectors through both.

:mod:`~airflow_nats_ordered.core.stream.frames` is the pure-Python reference and
``_frames`` its compiled twin (built at install where a C compiler is). Each vector goes
through both and must give the same result: header blocks (also against nats-py's own
``_parse_header_lines``), reply subjects' sequences (also the same error), and streams of
frames cut by :func:`cut` (the same deliveries, the same stops, the same stats; the
compiled one may also have read a delivery's sequences, which must then be the reference's),
and the reader's intake (gap check, request accounting, buffer, drain) on random scripts.
tests/core/stream/test_reader_frames.py and test_reader_header*.py check the twin in use
against nats-py's parser end to end."""

from __future__ import annotations

import importlib
import os
import random
from typing import Any

import pytest
from nats.aio.client import Client

from airflow_nats_ordered.core.stream import compiled, frames

# the twin itself, even where NATS_ORDERED_NO_EXTENSIONS keeps the reader off it
try:
    _c: Any = importlib.import_module("airflow_nats_ordered.core.stream._frames")
except ImportError:
    _c = None
if _c is None and os.environ.get("CI") and not compiled.disabled():
    raise AssertionError("CI: the compiled twin _frames was not built")

TWINS = [pytest.param("py", id="pure")] + [
    pytest.param(
        "c", id="compiled", marks=pytest.mark.skipif(_c is None, reason="_frames not built")
    )
]


def _twin(name: str) -> Any:
    if name == "py":
        return {
            "parse_headers": frames.parse_headers_py,
            "sequences": frames.sequences_py,
            "cut": frames.cut_py,
            "Delivery": frames.Delivery_py,
        }
    assert _c is not None
    return {
        "parse_headers": _c.parse_headers,
        "sequences": _c.sequences,
        "cut": _c.cut,
        "Delivery": _c.Delivery,
    }


PIECES = [
    b"a",
    b"Z",
    b"-",
    b":",
    b" ",
    b"\t",
    b"\x0b",
    b"\x0c",
    b"\x1c",
    b"\x1f",
    b"\x85",
    b"\xc2\xa0",
    b"\xe2\x80\x83",
    b"\xe2\x80",  # truncated
    b"\xc3\xa9",
    b"\xc3",
    b"\xff",
    b"\r",
    b"\n",
    b"\r\n",
    b"Nats-Msg-Id",
]


def _blocks(rnd: random.Random, count: int) -> list[bytes]:
    out = [b"", b"NATS/1.0", b"NATS/1.0\r\n", b"NATS/1.0\r\nK: v", b"NATS/1.0\r\n:\r\n\r\n"]
    for _ in range(count):
        lines = [
            b"".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 8)))
            for _ in range(rnd.randint(0, 5))
        ]
        out.append(b"NATS/1.0\r\n" + b"\r\n".join(lines) + rnd.choice([b"\r\n\r\n", b"\r\n", b""]))
    return out


@pytest.mark.parametrize("twin", TWINS)
def test_header_blocks_parse_as_nats_py_does(twin: str) -> None:
    parse = _twin(twin)["parse_headers"]
    for raw in _blocks(random.Random(33), 20_000):
        head, sep, rest = raw.partition(b"\r\n")
        expected = Client._parse_header_lines(rest) if sep else {}
        assert parse(raw) == expected, raw
    # names beyond any memory of seen names: the same
    for i in range(300):
        raw = b"NATS/1.0\r\nName-%d: %d\r\n Name-%d : x\r\n\r\n" % (i, i, i)
        assert parse(raw) == Client._parse_header_lines(raw[10:]), raw


def _replies(rnd: random.Random, count: int) -> list[str]:
    tokens = ["1", "22", "0", "007", "x", "", "-1", "+3", "1_0", " 4", "\u0663", "9" * 25, "$JS"]
    out = [
        "$JS.ACK.S.C.1.5.6.1700000000.0",
        "$JS.ACK.dom.hash.S.C.1.5.6.1700000000.0.tok",
        "$JS.ACK.dom.hash.S.C.1.5.6.1700000000.0",
        "a.b",
        "",
    ]
    for _ in range(count):
        out.append(".".join(rnd.choice(tokens) for _ in range(rnd.randint(1, 12))))
    return out


@pytest.mark.parametrize("twin", TWINS)
def test_reply_subjects_give_the_same_sequences_or_error(twin: str) -> None:
    sequences = _twin(twin)["sequences"]
    for reply in _replies(random.Random(7), 5_000):
        try:
            expected: Any = frames.sequences_py(reply)
        except (ValueError, IndexError) as exc:
            expected = type(exc)
        try:
            got: Any = sequences(reply)
        except (ValueError, IndexError) as exc:
            got = type(exc)
        assert got == expected, reply


def _token(rnd: random.Random) -> bytes:
    return rnd.choice(
        [
            b"a",
            b"$JS",
            b"ACK",
            b"_INBOX",
            b"x1",
            b"HMSG",
            b"MSG",
            b"7",
            b"\xc3" if rnd.random() < 0.1 else b"b",
        ]
    )


def _num(rnd: random.Random, value: int) -> bytes:
    """``value`` as a control line may (rarely) spell it, or a word nats-py cannot read."""
    r = rnd.random()
    if r < 0.9:
        return b"%d" % value
    return rnd.choice([b"+%d" % value, b"0%d" % value, b"x", b"-1", b"1_0", b"9" * 22])


def _ack(rnd: random.Random) -> bytes:
    seqs = b".".join(b"%d" % rnd.randint(1, 10 ** rnd.randint(1, 19)) for _ in range(2))
    return rnd.choice(
        [
            b"$JS.ACK.S.C.1." + seqs + b".17.0",
            b"$JS.ACK.d.h.S.C.1." + seqs + b".17.0.t",
        ]
    )


def _frames(rnd: random.Random, count: int) -> bytes:
    out = []
    for _ in range(count):
        kind = rnd.random()
        sid = 300 if rnd.random() < 0.02 else rnd.choice([1, 1, 1, 2, 3])
        subject = b".".join(_token(rnd) for _ in range(rnd.randint(1, 4)))
        r = rnd.random()
        if r < 0.5:
            reply = _ack(rnd)
        elif r < 0.8:
            reply = b".".join(_token(rnd) for _ in range(rnd.randint(1, 10)))
        else:
            reply = b""
        payload = bytes(rnd.choice(b"ab \r\nHMSG+OK") for _ in range(rnd.randint(0, 40)))
        ctl_reply = b" " + reply if reply else b""
        blank = rnd.choice([b" ", b" ", b"  ", b"\t"])
        if kind < 0.75:
            h = rnd.random()
            if h < 0.15:
                hdr = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 7\r\n\r\n"
            elif h < 0.2:
                hdr = b""
            elif h < 0.25:
                hdr = rnd.choice([b"NATS/1.0", b"NATS/1", b"NATS/1.0 "])
            else:
                hdr = b"NATS/1.0\r\nNats-Msg-Id: %d\r\nX: \r\nHMSG 1 2: 3\r\n\r\n" % rnd.randint(
                    0, 99
                )
            total = len(hdr) + len(payload)
            out.append(
                b"HMSG %s%s%s%s%s%s%s\r\n%s%s\r\n"
                % (
                    subject,
                    blank,
                    _num(rnd, sid),
                    ctl_reply,
                    blank,
                    _num(rnd, len(hdr)),
                    b" " + _num(rnd, total),
                    hdr,
                    payload,
                )
            )
        elif kind < 0.9:
            out.append(
                b"MSG %s %d%s %s\r\n%s\r\n"
                % (subject, sid, ctl_reply, _num(rnd, len(payload)), payload)
            )
        else:
            out.append(rnd.choice([b"+OK\r\n", b"PING\r\n", b"HMSG\r\n", b"MSG x\r\n"]))
    return b"".join(out)


def _run(twin: str, stream: bytes, in_place: bool) -> tuple[list[Any], dict[str, int]]:
    """What cut hands over and returns for ``stream``, read whole, as the reader's parse
    loop drives it."""
    t = _twin(twin)
    events: list[Any] = []
    stats = {"in_msgs": 0, "in_bytes": 0}

    def on_data(m: Any, hsize: int) -> None:
        assert type(m) is t["Delivery"]
        if m.seqs is not None:
            assert m.seqs == frames.sequences_py(m.reply)
        events.append(("data", m.subject, m.reply, m.data, m._raw, hsize))

    def failing(m: Any, hsize: int) -> None:
        raise RuntimeError("a handler's entry failing is logged, not raised")

    table: dict[int, Any] = {1: (None, on_data), 2: (None, None), 300: (None, failing)}
    chunk: Any = bytearray(stream) if in_place else stream
    pos = 0
    while True:
        pos, frame_end, frame = t["cut"](chunk, pos, table, stats)
        events.append(("stop", pos, frame_end, frame))
        if frame_end < 0:
            break
        pos = frame_end
    return events, stats


def test_cut_gives_the_same_frames_in_both_twins() -> None:
    if _c is None:
        pytest.skip("_frames not built")
    rnd = random.Random(330)
    for _ in range(800):
        stream = _frames(rnd, rnd.randint(1, 25))
        stream = stream[: rnd.randint(0, len(stream))] if rnd.random() < 0.3 else stream
        expected = _run("py", stream, in_place=False)
        assert _run("c", stream, in_place=True) == expected, stream
        assert _run("c", stream, in_place=False) == expected, stream


@pytest.mark.parametrize("twin", TWINS)
def test_a_delivery_parses_its_headers_once_on_first_use(twin: str) -> None:
    delivery = _twin(twin)["Delivery"]
    raw = b"NATS/1.0\r\nNats-Msg-Id: a\r\n\r\n"
    m = delivery("s", "r", b"d", raw)
    assert (m.subject, m.reply, m.data, m._raw, m.seqs) == ("s", "r", b"d", raw, None)
    assert m.headers == {"Nats-Msg-Id": "a"} and m._raw is None
    assert m.headers is m.headers
    assert delivery("s", "r", b"d", None, {"Status": "100"}).headers == {"Status": "100"}
    assert delivery("s", "r", b"d", None).headers is None


class _Msg:
    """A message that is not a Delivery (nats-py's ``Msg`` has these attributes)."""

    def __init__(self, subject: str, reply: str, data: bytes) -> None:
        self.subject, self.reply, self.data = subject, reply, data


def _intake(twin: str, rnd: random.Random, steps: int) -> list[Any]:
    """A reader's intake driven by a random script: deliveries (in order, skipped, repeated,
    unreadable replies, not Deliveries), pull requests, drains, the reader's resets; its
    state after every step."""
    import asyncio

    t = _twin(twin)
    inbox_type = frames.Inbox_py if twin == "py" else _c.Inbox
    ready = asyncio.Event()
    gaps: list[int] = []
    inbox = inbox_type(ready, gaps.append)
    out: list[Any] = []
    cseq = seq = 0
    next_seq = 1
    for _ in range(steps):
        r = rnd.random()
        if r < 0.6:
            step = rnd.choice([1, 1, 1, 1, 1, 1, 2, 0, -3])
            cseq, seq = max(0, cseq + step), max(0, seq + step + rnd.randint(0, 1))
            reply = rnd.choice(
                [
                    f"$JS.ACK.S.C.1.{seq}.{cseq}.17.0",
                    f"$JS.ACK.d.h.S.C.1.{seq}.{cseq}.17.0.t",
                    f"$JS.ACK.S.C.1.x.{cseq}.17.0",
                    "",
                ]
                if rnd.random() < 0.1
                else [f"$JS.ACK.S.C.1.{seq}.{cseq}.17.0"]
            )
            data = b"d" * rnd.randint(0, 9)
            if rnd.random() < 0.1:
                m: Any = _Msg("in.box", reply, data)
            else:
                m = t["Delivery"]("in.box", reply, data, b"NATS/1.0\r\nK: v\r\n\r\n")
                if twin == "c":  # as the compiled cutter does
                    try:
                        m.seqs = frames.sequences_py(reply)
                    except (ValueError, IndexError):
                        m.seqs = None
            try:
                inbox.entry(m, rnd.randint(0, 30))
                out.append("taken")
            except (ValueError, IndexError) as exc:
                out.append(type(exc))
        elif r < 0.7:
            inbox.requests.append([rnd.randint(1, 5), rnd.randint(0, 300), 0])
        elif r < 0.85:
            taken, next_seq = inbox.drain(rnd.randint(1, 6), next_seq)
            out.append([(s, m.reply) for s, m in taken])
            if not inbox.buf:
                ready.clear()
        elif r < 0.9:
            next_seq = max(1, next_seq - rnd.randint(0, 3))
        else:
            inbox.requests.clear()
        if inbox.lost and rnd.random() < 0.3:  # the reader re-created its consumer
            inbox.lost, inbox.cseq, cseq = False, 0, 0
        out.append(
            (
                inbox.cseq,
                bool(inbox.lost),
                inbox.buf_bytes,
                [list(q) for q in inbox.requests],
                [(s, size) for s, _, size in inbox.buf],
                ready.is_set(),
                list(gaps),
                next_seq,
            )
        )
    return out


def test_the_intake_does_the_same_in_both_twins() -> None:
    if _c is None:
        pytest.skip("_frames not built")
    for i in range(40):
        assert _intake("c", random.Random(i), 300) == _intake("py", random.Random(i), 300), i


def test_the_intake_keeps_ready_set_while_anything_is_buffered() -> None:
    for twin in ["py"] + (["c"] if _c is not None else []):
        rnd = random.Random(5)
        for state in _intake(twin, rnd, 2000):
            if isinstance(state, tuple) and state[4]:
                assert state[5], (twin, state)
