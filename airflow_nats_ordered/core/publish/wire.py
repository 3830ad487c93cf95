"""Pre-encoded publishing: header blocks built once per record, frames written directly.

nats-py re-validates and re-encodes a header dict on every ``publish``; for the ordered
publisher that is most of the per-message cost (see ``docs/benchmarks.md``). Records here
carry their header block as bytes, built and validated once, and :func:`send` appends the
``HPUB`` frame to the client's outbound buffer exactly as ``Client.publish`` does, honouring
its closed/reconnecting checks, pending-size limit and flusher. If a future nats-py changes
those internals, :func:`supports_fast_path` is False and :func:`send` falls back to the
public ``publish`` with a decoded header dict, which is slower but equivalent.

The ordered publisher writes every message through :func:`send_frames` (ready frames, one
command per call on the fast path, one ``publish`` each on the fallback): it is the one
place its messages reach the connection, and the seam the fault tests break.
"""

from __future__ import annotations

import re
from typing import Any

from nats import errors as nats_errors
from nats.aio.client import Client as NATS

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def header_block(headers: dict[str, str]) -> bytes:
    """Encode headers as a NATS/1.0 block. Raises ValueError for a bad name or value."""
    parts = [b"NATS/1.0\r\n"]
    for k, v in headers.items():
        if not _TOKEN.match(k):
            raise ValueError(f"header name {k!r} is not a valid token")
        if "\r" in v or "\n" in v:
            raise ValueError(f"header {k!r} value must not contain line breaks")
        parts.append(f"{k}: {v.strip()}\r\n".encode())
    parts.append(b"\r\n")
    return b"".join(parts)


def parse_header_block(block: bytes) -> dict[str, str]:
    """Inverse of :func:`header_block` (last value wins), for the fallback path."""
    out: dict[str, str] = {}
    for line in block.decode().split("\r\n")[1:]:
        if line:
            k, _, v = line.partition(":")
            out[k.strip()] = v.strip()
    return out


def supports_fast_path(nc: NATS) -> bool:
    return all(
        hasattr(nc, name)
        for name in (
            "_send_command",
            "_flush_pending",
            "_flush_queue",
            "_max_pending_size",
            "_pending_data_size",
            "stats",
            "is_connected",
            "is_closed",
        )
    )


async def send(nc: NATS, fast: bool, subject: bytes, reply: bytes, hdr: bytes, data: bytes) -> None:
    """Publish one message whose subject, reply and header block are already encoded."""
    if not fast:
        await nc.publish(
            subject.decode(), data, reply=reply.decode(), headers=parse_header_block(hdr)
        )
        return
    if nc.is_closed:
        raise nats_errors.ConnectionClosedError
    size = len(hdr) + len(data)
    if not nc.is_connected and (
        nc._max_pending_size <= 0 or size + nc._pending_data_size > nc._max_pending_size
    ):
        raise nats_errors.OutboundBufferLimitError
    if size > nc.max_payload:
        raise nats_errors.MaxPayloadError
    cmd = b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject, reply, len(hdr), size, hdr, data)
    stats: Any = nc.stats
    stats["out_msgs"] += 1
    stats["out_bytes"] += len(data)
    await nc._send_command(cmd)
    fq = nc._flush_queue
    if fq is not None and fq.empty():
        await nc._flush_pending()


def frame(subject: bytes, reply: bytes, hdr: bytes, data: bytes) -> bytes:
    """One ``HPUB`` frame, exactly as :func:`send` writes it."""
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
        subject,
        reply,
        len(hdr),
        len(hdr) + len(data),
        hdr,
        data,
    )


async def send_frames(
    nc: NATS, fast: bool, frames: list[bytes], payload: int, largest: int
) -> None:
    """Write ready ``HPUB`` frames (:func:`frame`), in order.

    ``payload`` is their payload bytes (the client's ``out_bytes``) and ``largest`` the
    biggest header block + payload among them. On the fast path they are one command, all or
    nothing: when this raises (the same errors as :func:`send`), none of them was queued.
    Without it (``fast`` False) each is published in turn with ``Client.publish``, so a
    failure may leave a prefix of them queued."""
    if not fast:
        for f in frames:
            line, _, rest = f.partition(b"\r\n")
            _, subject, reply, hlen, tlen = line.split(b" ")
            hdr, data = rest[: int(hlen)], rest[int(hlen) : int(tlen)]
            await send(nc, False, subject, reply, hdr, data)
        return
    if nc.is_closed:
        raise nats_errors.ConnectionClosedError
    blob = b"".join(frames)
    if not nc.is_connected and (
        nc._max_pending_size <= 0 or len(blob) + nc._pending_data_size > nc._max_pending_size
    ):
        raise nats_errors.OutboundBufferLimitError
    if largest > nc.max_payload:
        raise nats_errors.MaxPayloadError
    stats: Any = nc.stats
    stats["out_msgs"] += len(frames)
    stats["out_bytes"] += payload
    await nc._send_command(blob)
    fq = nc._flush_queue
    if fq is not None and fq.empty():
        await nc._flush_pending()
