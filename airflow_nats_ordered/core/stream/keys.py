"""Key text on the wire: how a record's key travels in its headers and is read back.

The contract (``docs/protocol.md`` has the worked examples and golden vectors):

* A **key** is text: a non-empty string whose UTF-8 encoding is at most
  :data:`MAX_KEY_BYTES` (4096) bytes. ``bytes`` keys are accepted when they are valid UTF-8.
  An empty key (or None) means *keyless*. Invalid UTF-8, lone surrogates and longer keys are
  refused before anything is sent (:class:`~..errors.InvalidKeyError`, naming the key).
* **Plain form** ``Nats-Ordered-Key: <key>`` when the key is *header-safe*: every character
  is printable ASCII (U+0020..U+007E) and it neither starts nor ends with a blank (U+0020).
  NATS clients trim header values and forbid line breaks, so only such keys survive a
  header unchanged.
* **Encoded form** ``Nats-Ordered-Key-B64: <base64 of the key's UTF-8 bytes>`` (RFC 4648
  section 4, standard alphabet, ``=`` padding, no line breaks) for every other key: leading
  or trailing blanks, any non-ASCII character (U+00A0, U+3000, ``Zürich``), tabs, CR/LF, NUL
  and other control characters. Such keys arrive byte-exact.
* A writer sets exactly one of the two headers (none for a keyless record). A writer may use
  the encoded form for any key; this package uses the plain form whenever the key is
  header-safe.
* A reader (:func:`message_key`) decodes ``Nats-Ordered-Key-B64`` when present (strictly:
  canonical base64, valid UTF-8, non-empty, and not together with ``Nats-Ordered-Key``,
  else :class:`~..errors.KeyEncodingError`); otherwise it takes ``Nats-Ordered-Key`` as is.
* The partition and the derived msg-id use the key's exact UTF-8 bytes, whichever form
  carried it.

**Key text of a record field** (:func:`key_text`, the same in the CLI, the operator and
Spark): a string is itself; an integer is its exact decimal digits; UTF-8 binary is its
text; null, missing or empty is keyless; everything else (floats, decimals, booleans,
objects, arrays, dates, timestamps) is refused, because its text differs between languages.

This module is the one place that builds or reads the key headers.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import decimal
from collections.abc import Mapping
from typing import Any

from airflow_nats_ordered.core.errors import InvalidKeyError, KeyEncodingError, KeyTextError

__all__ = [
    "HDR_KEY",
    "HDR_KEY_B64",
    "MAX_KEY_BYTES",
    "is_header_safe",
    "key_header",
    "key_field_text",
    "key_header_line",
    "key_text",
    "key_utf8",
    "message_key",
    "quote_key",
]

#: plain form of the key header: the key itself (header-safe keys only)
HDR_KEY = "Nats-Ordered-Key"
#: encoded form of the key header: standard base64 of the key's UTF-8 bytes
HDR_KEY_B64 = "Nats-Ordered-Key-B64"
#: the longest key, in UTF-8 bytes
MAX_KEY_BYTES = 4096

#: how many characters of a key an error message quotes
_QUOTE = 60


def quote_key(key: str | bytes) -> str:
    """``repr(key)``, shortened for an error message: a long key is cut after
    :data:`_QUOTE` characters of its repr and followed by ``... (N characters)``."""
    text = repr(key)
    if len(text) <= _QUOTE:
        return text
    return f"{text[:_QUOTE]}... ({len(key)} {'characters' if isinstance(key, str) else 'bytes'})"


#: the ASCII characters a plain key header cannot carry (controls, DEL)
_NOT_PRINTABLE = bytes(range(0x20)) + b"\x7f"
#: up to this length str.isprintable() is the faster check; beyond, bytes.translate()
_SHORT = 64


def _printable(ascii_key: str, kb: bytes) -> bool:
    """All of an ASCII key is U+0020..U+007E (``kb`` is its encoding)."""
    if len(ascii_key) <= _SHORT:
        return ascii_key.isprintable()
    return len(kb.translate(None, _NOT_PRINTABLE)) == len(kb)


def is_header_safe(key: str) -> bool:
    """True if ``key`` travels unchanged in the plain ``Nats-Ordered-Key`` header: non-empty,
    printable ASCII only (U+0020..U+007E), no leading or trailing blank."""
    return (
        key != ""
        and key.isascii()
        and key[0] != " "
        and key[-1] != " "
        and _printable(key, key.encode("ascii"))
    )


def key_utf8(key: str | bytes) -> bytes:
    """The exact UTF-8 bytes of a non-empty key (what is hashed and sent).

    Raises :class:`InvalidKeyError` (naming the key) for invalid UTF-8, a lone surrogate,
    an empty key, or a key longer than :data:`MAX_KEY_BYTES` bytes."""
    if isinstance(key, str):
        try:
            kb = key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidKeyError(
                f"{quote_key(key)} is not valid text: it contains a lone surrogate "
                f"({key[exc.start]!r} at position {exc.start}); a key must be valid Unicode"
            ) from exc
    elif isinstance(key, (bytes, bytearray, memoryview)):
        kb = bytes(key)
        try:
            kb.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidKeyError(
                f"{quote_key(kb)} is not valid UTF-8 (byte {exc.start}); a key must be text: "
                "give it as str, or as bytes that are UTF-8"
            ) from exc
    else:
        raise InvalidKeyError(
            f"{quote_key(repr(key))} is a {type(key).__name__}; a key must be str (or UTF-8 bytes)"
        )
    if not kb:
        raise InvalidKeyError("is empty; an empty key means keyless (send no key instead)")
    if len(kb) > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"{quote_key(key)} is {len(kb)} bytes in UTF-8; at most {MAX_KEY_BYTES}: "
            "shorten the key (or hash it to a shorter one)"
        )
    return kb


def key_header(key: str | bytes) -> tuple[str, bytes]:
    """The one header that carries ``key``: ``(name, value bytes)``.

    ``(HDR_KEY, utf8(key))`` for a header-safe key, else ``(HDR_KEY_B64, base64(utf8(key)))``.
    Raises :class:`InvalidKeyError` as :func:`key_utf8` does."""
    kb = key_utf8(key)
    text = key if isinstance(key, str) else kb.decode("utf-8")
    if is_header_safe(text):
        return HDR_KEY, kb
    return HDR_KEY_B64, base64.b64encode(kb)


_PLAIN_LINE = HDR_KEY.encode() + b": %s\r\n"
_B64_LINE = HDR_KEY_B64.encode() + b": %s\r\n"


def key_header_line(key: str | bytes) -> tuple[bytes, bytes]:
    """``(utf8(key), header line)``: the key's exact UTF-8 bytes (to hash and to derive a
    msg-id from) and its one header as a ready ``b"Name: value\\r\\n"`` line of a NATS/1.0
    block, as :func:`key_header` decides. Raises :class:`InvalidKeyError` as
    :func:`key_utf8` does. (The publisher's per-record path: a header-safe ``str`` key
    costs one check and one encode.)"""
    if (
        key.__class__ is str
        and 0 < len(key) <= MAX_KEY_BYTES
        and key.isascii()
        and key[0] != " "
        and key[-1] != " "
    ):
        kb = key.encode()
        if _printable(key, kb):
            return kb, _PLAIN_LINE % kb
        return kb, _B64_LINE % base64.b64encode(kb)
    kb = key_utf8(key)
    if is_header_safe(key if isinstance(key, str) else kb.decode("utf-8")):
        return kb, _PLAIN_LINE % kb
    return kb, _B64_LINE % base64.b64encode(kb)


def message_key(headers: Mapping[str, str] | None) -> str | None:
    """The key a record was published with, byte-exact, or None for a keyless record.

    Raises :class:`KeyEncodingError` when ``Nats-Ordered-Key-B64`` is not canonical base64
    of non-empty UTF-8, or when both key headers are present."""
    if not headers:
        return None
    encoded = headers.get(HDR_KEY_B64)
    if encoded is None:
        value = headers.get(HDR_KEY)
        return value if value else None
    if headers.get(HDR_KEY) is not None:
        raise KeyEncodingError(
            f"both {HDR_KEY} and {HDR_KEY_B64} are set; a record carries its key in exactly "
            "one of them"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KeyEncodingError(
            f"{HDR_KEY_B64} {quote_key(encoded)} is not valid base64 ({exc})"
        ) from exc
    if base64.b64encode(raw).decode("ascii") != encoded:
        raise KeyEncodingError(
            f"{HDR_KEY_B64} {quote_key(encoded)} is not canonical base64 (RFC 4648 section 4: "
            "standard alphabet, '=' padding, zero pad bits, no line breaks)"
        )
    if not raw:
        raise KeyEncodingError(f"{HDR_KEY_B64} is empty; a keyless record carries no key header")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeyEncodingError(
            f"{HDR_KEY_B64} {quote_key(encoded)} decodes to bytes that are not valid UTF-8 "
            f"(byte {exc.start}); a key is text"
        ) from exc


# ------------------------------------------------------------------ key text of a field

_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),
    (float, "a floating-point number"),
    (decimal.Decimal, "a decimal number"),
    (dict, "an object"),
    (list, "an array"),
    (tuple, "an array"),
    (dt.datetime, "a timestamp"),
    (dt.date, "a date"),
    (dt.time, "a time of day"),
    (dt.timedelta, "a duration"),
)


def key_text(value: Any) -> str | None:
    """The canonical key (or msg-id) text of a record field's value; ``None`` (keyless)
    for a null, missing (None) or empty value. The same rule as Spark's ``write_ordered``,
    the CLI and the operator, reproducible in any language:

    * a string is itself;
    * an integer (a JSON number without fraction or exponent, a Parquet/Arrow/Spark
      integral value, a Python ``int`` but not ``bool``) is its decimal digits, ``-`` for
      negatives, no ``+``, no leading zeros, exact at any size
      (``10**22`` -> ``"10000000000000000000000"``);
    * binary (Parquet/Spark binary, Python ``bytes``) is its bytes, which must be UTF-8;
    * everything else is refused with :class:`KeyTextError` saying to make the field a
      string: floating-point and decimal numbers (``1.0``, ``3e-07``: their text differs
      between languages), booleans, objects, arrays, dates, timestamps.

    Text that cannot be sent (a lone surrogate, invalid UTF-8) is refused the same way;
    :func:`key_field_text` also refuses keys over :data:`MAX_KEY_BYTES`.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise KeyTextError(
                f"{quote_key(value)} is not valid text: it holds a lone surrogate at "
                f"position {exc.start}; fix the value"
            ) from None
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return str(value)
        except ValueError:  # over Python's int-to-text digit limit, far over a key's length
            raise KeyTextError(
                f"is an integer of {value.bit_length()} bits, longer than a key may be "
                f"({MAX_KEY_BYTES} bytes): use a shorter key"
            ) from None
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KeyTextError(
                f"{quote_key(raw)} is binary that is not UTF-8 (byte {exc.start}); a key is "
                "text: make the field a UTF-8 string"
            ) from None
    kind = next((n for t, n in _TYPE_NAMES if isinstance(value, t)), None)
    kind = kind or f"a {type(value).__name__}"
    shown = repr(value)
    if len(shown) > _QUOTE:
        shown = shown[:_QUOTE] + "..."
    raise KeyTextError(
        f"{shown} is {kind}; key text must be the same in every language, so only strings, "
        "integers and UTF-8 binary are keys: make the field a string"
    )


def key_field_text(value: Any) -> str | None:
    """:func:`key_text` of a key field's value, refusing also text longer than a key may
    be (:data:`MAX_KEY_BYTES` bytes in UTF-8) with :class:`KeyTextError`."""
    text = key_text(value)
    if text is not None:
        n = len(text.encode("utf-8"))
        if n > MAX_KEY_BYTES:
            raise KeyTextError(
                f"{quote_key(text)} is {n} bytes in UTF-8; at most {MAX_KEY_BYTES}: "
                "shorten the key (or hash it to a shorter one)"
            )
    return text
