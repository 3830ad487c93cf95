"""Key text on the wire: how a record's key travels in its headers and is read back.

(Interface placeholder: the key-encoding work replaces the body; callers use only
:func:`message_key`.)
"""

from __future__ import annotations

from collections.abc import Mapping

HDR_KEY = "Nats-Ordered-Key"


def message_key(headers: Mapping[str, str] | None) -> str | None:
    """The key a record was published with, exactly as given, or None for a keyless record."""
    value = (headers or {}).get(HDR_KEY)
    return value if value else None
