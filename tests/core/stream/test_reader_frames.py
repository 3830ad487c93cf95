"""The reader cuts the frames of a read itself (issue 33): exactly what nats-py's parser does.

:func:`~airflow_nats_ordered.core.stream.reader._route` replaces the connection's protocol
parser's ``parse`` with one that hands a reader's data deliveries to it without nats-py's
per-message work and every other frame to nats-py's own parser, one whole frame at a time.
What reaches the readers, the commit answers and nats-py must not change: generated
streams of frames (deliveries, statuses, other subscriptions' messages, ``+OK``, payloads
containing CRLF and protocol words), cut into reads at random places, give exactly the
calls nats-py's own parser gives under the same routing. End to end on a real server:
every test of tests/core/worker and tests/core/stream/test_reader_headers.py."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from nats.aio.client import Client

from airflow_nats_ordered.core.stream.reader import _route

Event = tuple[Any, ...]


class Target:
    """A route's target, recording what it is handed."""

    def __init__(self, name: str, events: list[Event]) -> None:
        self.name = name
        self.events = events

    def on_data(self, m: Any, hsize: int) -> None:
        self.events.append(("data", self.name, m.subject, m.reply, m.data, m._raw, hsize))

    async def _on_msg(self, m: Any) -> None:
        self.events.append(("msg", self.name, m.subject, m.reply, m.data, m._raw, m._headers))


def _client(fast: bool) -> tuple[Client, list[Event]]:
    nc = Client()
    events: list[Event] = []

    async def nats_py_process_msg(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        events.append(("nats-py", sid, subject, reply, data, headers))

    nc._process_msg = nats_py_process_msg  # type: ignore[method-assign]
    routes = _route(nc)
    assert routes is not None
    reader = Target("reader", events)
    routes[1] = (reader, reader.on_data)
    routes[2] = (Target("answers", events), None)
    if fast:
        assert "parse" in vars(nc._ps), "the frame cutter is installed"
    else:
        del nc._ps.parse  # nats-py's own parser, under the same routing
    return nc, events


def _token(rnd: random.Random) -> bytes:
    return rnd.choice([b"a", b"$JS", b"ACK", b"_INBOX", b"x1", b"HMSG", b"MSG"])


def _frames(rnd: random.Random, count: int) -> bytes:
    out = []
    for _ in range(count):
        kind = rnd.random()
        sid = rnd.choice([1, 1, 1, 2, 3])
        subject = b".".join(_token(rnd) for _ in range(rnd.randint(1, 4)))
        reply = (
            b".".join(_token(rnd) for _ in range(rnd.randint(1, 9))) if rnd.random() < 0.8 else b""
        )
        payload = bytes(rnd.choice(b"ab \r\nHMSG+OK") for _ in range(rnd.randint(0, 40)))
        ctl_reply = b" " + reply if reply else b""
        if kind < 0.7:
            if rnd.random() < 0.15:
                hdr = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 7\r\n\r\n"
            elif rnd.random() < 0.05:
                hdr = b""
            else:
                hdr = b"NATS/1.0\r\nNats-Msg-Id: %d\r\nX: \r\nHMSG 1 2: 3\r\n\r\n" % rnd.randint(
                    0, 99
                )
            out.append(
                b"HMSG %s %d%s %d %d\r\n%s%s\r\n"
                % (subject, sid, ctl_reply, len(hdr), len(hdr) + len(payload), hdr, payload)
            )
        elif kind < 0.9:
            out.append(
                b"MSG %s %d%s %d\r\n%s\r\n" % (subject, sid, ctl_reply, len(payload), payload)
            )
        else:
            out.append(b"+OK\r\n")
    return b"".join(out)


async def _feed(nc: Client, stream: bytes, cuts: list[int]) -> None:
    at = 0
    for cut in [*cuts, len(stream)]:
        await nc._ps.parse(stream[at:cut])
        at = cut


def test_frames_reach_the_same_targets_as_with_nats_py_s_parser() -> None:
    rnd = random.Random(33)

    async def main() -> None:
        for _ in range(300):
            stream = _frames(rnd, rnd.randint(1, 30))
            how = rnd.random()
            if how < 0.2:
                cuts = list(range(1, len(stream)))  # a byte per read
            elif how < 0.4:
                cuts = []  # one read
            else:
                cuts = sorted(rnd.sample(range(1, max(2, len(stream))), min(len(stream) - 1, 6)))
            slow, expected = _client(fast=False)
            await _feed(slow, stream, cuts)
            fast, got = _client(fast=True)
            await _feed(fast, stream, cuts)
            assert got == expected, stream
            assert bytes(fast._ps.buf) == bytes(slow._ps.buf) == b""
            assert fast.stats["in_msgs"] == slow.stats["in_msgs"]
            assert fast.stats["in_bytes"] == slow.stats["in_bytes"]

    asyncio.run(main())


def test_an_incomplete_frame_waits_for_the_next_read() -> None:
    async def main() -> None:
        nc, events = _client(fast=True)
        hdr = b"NATS/1.0\r\nNats-Msg-Id: 1\r\n\r\n"
        frame = b"HMSG s 1 r %d %d\r\n%sdata\r\n" % (len(hdr), len(hdr) + 4, hdr)
        await nc._ps.parse(frame + frame[:-3])
        assert len(events) == 1
        assert bytes(nc._ps.buf) == frame[:-3]
        await nc._ps.parse(frame[-3:])
        assert len(events) == 2 and events[0] == events[1]
        assert events[0] == ("data", "reader", "s", "r", b"data", hdr, len(hdr))

    asyncio.run(main())
