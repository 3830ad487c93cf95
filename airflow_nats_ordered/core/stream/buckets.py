"""The KV buckets named after a stream that the stream wing itself must recognise.

A stream published in global order keeps per-partition watermarks in the bucket
``nor_<stream>_global``. Global order (:mod:`..order.watermarks`) writes and reads it;
:func:`~.repartition.repartition` refuses such a stream, whose watermarks and readers
follow one partition layout. The name lives here so that the stream wing can recognise the
bucket without importing global order, which builds on it.
"""

from __future__ import annotations


def watermark_bucket(stream: str) -> str:
    """The KV bucket holding the stream's per-partition watermarks (keys ``w.<n>``)."""
    return f"nor_{stream}_global"
