"""The key-on-the-wire contract on plain values (core/stream/keys.py): which form carries a key,
that every key reads back byte-exact, and what is refused on either side."""

from __future__ import annotations

import base64

import pytest

from airflow_nats_ordered.core.errors import InvalidKeyError, KeyEncodingError
from airflow_nats_ordered.core.stream.keys import (
    HDR_KEY,
    HDR_KEY_B64,
    MAX_KEY_BYTES,
    is_header_safe,
    key_header,
    key_header_line,
    key_utf8,
    message_key,
)

UNSAFE = [
    " lead",
    "trail ",
    " ",
    "\u00a0nbsp",
    "ideo\u3000",
    "a\r\nb",
    "tab\there",
    "nul\x00",
    "del\x7f",
    "Zürich",
    "🙂",
    "é" * (MAX_KEY_BYTES // 2),
]
SAFE = ["plain-key", "a", "a b", "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./", "x" * MAX_KEY_BYTES]


@pytest.mark.parametrize("key", SAFE)
def test_a_header_safe_key_travels_plain(key):
    assert is_header_safe(key)
    assert key_header(key) == (HDR_KEY, key.encode())
    assert message_key({HDR_KEY: key}) == key


@pytest.mark.parametrize("key", UNSAFE)
def test_every_other_key_travels_base64_and_reads_back_byte_exact(key):
    assert not is_header_safe(key)
    name, value = key_header(key)
    assert name == HDR_KEY_B64
    assert value == base64.b64encode(key.encode("utf-8"))
    assert b"\r" not in value and b"\n" not in value and value.strip() == value
    assert message_key({HDR_KEY_B64: value.decode()}) == key


def test_bytes_keys_are_their_utf8_text():
    assert key_header("Zürich".encode()) == key_header("Zürich")
    assert key_header(b"plain") == (HDR_KEY, b"plain")


def test_the_longest_key_passes_and_one_byte_more_is_refused_naming_the_key():
    assert len(key_utf8("k" * MAX_KEY_BYTES)) == MAX_KEY_BYTES
    with pytest.raises(InvalidKeyError) as err:
        key_header("k" * (MAX_KEY_BYTES + 1))
    assert str(err.value).startswith("key 'kkkk")
    assert "is 4097 bytes in UTF-8; at most 4096" in str(err.value)
    # multi-byte characters count in bytes, not characters
    with pytest.raises(InvalidKeyError, match="is 4098 bytes in UTF-8; at most 4096"):
        key_header("é" * 2049)


def test_invalid_utf8_and_lone_surrogates_are_refused_naming_the_key():
    with pytest.raises(InvalidKeyError, match=r"^key b'bad\\xff' is not valid UTF-8"):
        key_header(b"bad\xff")
    with pytest.raises(InvalidKeyError, match=r"^key 'x\\ud800' is not valid text"):
        key_header("x\ud800")


def test_an_adapter_words_the_refusal_in_its_terms():
    with pytest.raises(InvalidKeyError) as err:
        key_header(b"\xff")
    assert err.value.message_for("--key-field 'k' value").startswith(
        "--key-field 'k' value b'\\xff' is not valid UTF-8"
    )


def test_an_empty_key_is_not_a_key():
    with pytest.raises(InvalidKeyError, match="keyless"):
        key_header("")


@pytest.mark.parametrize("headers", [None, {}, {"Other": "x"}, {HDR_KEY: ""}])
def test_no_key_header_reads_as_keyless(headers):
    assert message_key(headers) is None


@pytest.mark.parametrize(
    "encoded, why",
    [
        ("%%%", "not valid base64"),
        ("bGVhZA", "not valid base64"),  # missing padding
        ("bGVhZA==\r\n", "not valid base64"),
        ("bGVhZB==", "not canonical base64"),  # non-zero pad bits
        ("/w==", "not valid UTF-8"),
        ("7aCA", "not valid UTF-8"),  # an encoded lone surrogate
        ("", "is empty"),
        ("bGVhZA==ü", "not valid base64"),
    ],
)
def test_a_malformed_encoded_key_raises_key_encoding_error(encoded, why):
    with pytest.raises(KeyEncodingError, match=why):
        message_key({HDR_KEY_B64: encoded})


def test_both_key_headers_at_once_are_malformed():
    with pytest.raises(KeyEncodingError, match="both"):
        message_key({HDR_KEY: "lead", HDR_KEY_B64: "IGxlYWQ="})


def test_a_foreign_writer_may_encode_a_safe_key_too():
    assert message_key({HDR_KEY_B64: base64.b64encode(b"plain-key").decode()}) == "plain-key"


@pytest.mark.parametrize("length", [1, 64, 65, 300])
def test_every_ascii_character_is_judged_the_same_in_short_and_long_keys(length):
    for code in range(128):
        key = "k" * length + chr(code) + "k"
        safe = 0x20 <= code <= 0x7E
        assert is_header_safe(key) is safe, (length, code)
        assert key_header(key)[0] == (HDR_KEY if safe else HDR_KEY_B64), (length, code)
        assert key_header_line(key) == (
            key.encode(),
            b"%s: %s\r\n" % (key_header(key)[0].encode(), key_header(key)[1]),
        )
