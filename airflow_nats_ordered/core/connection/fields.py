"""Connection option vocabulary and single-value parsing, shared by options and connect.

The names every other connection module agrees on: the default server, the ``nats``
CLI's environment variables (:data:`ENV_VARS`), which options are secret, files,
numbers or booleans, and the auth hint used in messages. Plus the parsing of one raw
value at a time, before :class:`~.options.
ConnectionOptions` checks how the values combine: server URL normalisation (credentials
moved out of URLs, never shown in messages), positive numbers, and coercion of strings
from environment variables or JSON (Airflow extras) into each option's type.
Invalid values raise :class:`~..errors.ConfigError` that
remembers the option name (see :func:`_config_error`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from airflow_nats_ordered.core.errors import ConfigError

__all__ = ["DEFAULT_SERVER", "ENV_VARS"]

DEFAULT_SERVER = "nats://127.0.0.1:4222"

#: Environment variable -> ConnectionOptions field. The first nine are the ``nats`` CLI's;
#: the CLI has only flags (``--inbox-prefix``, ``--js-domain``, ``--js-api-prefix``) for the
#: last three, whose variables are named after those flags.
ENV_VARS: Mapping[str, str] = {
    "NATS_URL": "servers",
    "NATS_USER": "user",
    "NATS_PASSWORD": "password",
    "NATS_TOKEN": "token",
    "NATS_CREDS": "creds_file",
    "NATS_NKEY": "nkey_seed_file",
    "NATS_CA": "tls_ca_file",
    "NATS_CERT": "tls_cert_file",
    "NATS_KEY": "tls_key_file",
    "NATS_INBOX_PREFIX": "inbox_prefix",
    "NATS_JS_DOMAIN": "js_domain",
    "NATS_JS_API_PREFIX": "js_api_prefix",
}
_FIELD_TO_ENV = {v: k for k, v in ENV_VARS.items()}

_SCHEMES = ("nats", "tls", "ws", "wss")
_SECRET_FIELDS = ("password", "token", "nkey_seed")
_FILE_FIELDS = ("creds_file", "nkey_seed_file", "tls_ca_file", "tls_cert_file", "tls_key_file")
#: the settings that name subjects: the reply inbox and the JetStream API (see api.py)
_SUBJECT_FIELDS = ("inbox_prefix", "js_domain", "js_api_prefix")
_OPTIONAL_STR_FIELDS = (
    "user",
    "password",
    "token",
    "nkey_seed",
    "tls_hostname",
    *_FILE_FIELDS,
    *_SUBJECT_FIELDS,
)
_FLOAT_FIELDS = ("connect_timeout", "reconnect_time_wait", "ping_interval")
_INT_FIELDS = ("max_reconnect_attempts", "max_outstanding_pings")
_BOOL_FIELDS = ("tls_verify",)

_AUTH_HINT = (
    "set exactly one of: user + password (NATS_USER / NATS_PASSWORD), token (NATS_TOKEN), "
    "creds_file (NATS_CREDS) or nkey_seed_file / nkey_seed (NATS_NKEY)"
)


def _config_error(field_name: str, message: str) -> ConfigError:
    """A ConfigError that remembers which option was wrong (used to add env var names)."""
    err = ConfigError(message)
    err.field = field_name  # type: ignore[attr-defined]
    return err


def _strip_userinfo(url: str) -> str:
    """``url`` without ``user:password@`` (for messages; never shows credentials)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def _normalize_server(url: str, index: int) -> tuple[str, str | None, str | None]:
    """Validate one server URL; return (url without userinfo, url user, url password).

    A bare ``host`` or ``host:port`` becomes ``nats://host:port`` (port 4222 if absent).
    """
    where = f"servers[{index}]"
    raw = url.strip()
    if not raw:
        raise _config_error("servers", f"{where} is empty; give a URL like {DEFAULT_SERVER}")
    if "://" not in raw:
        raw = f"nats://{raw}"
    shown = _strip_userinfo(raw)
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise _config_error(
            "servers", f"{where} {shown!r} is not a valid URL ({exc}); use e.g. {DEFAULT_SERVER}"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise _config_error(
            "servers",
            f"{where} {shown!r} has unsupported scheme {parts.scheme!r}; use one of "
            f"{', '.join(s + '://' for s in _SCHEMES)} or a bare host:port",
        )
    if not parts.hostname:
        raise _config_error("servers", f"{where} {shown!r} has no host; use e.g. {DEFAULT_SERVER}")
    if scheme in ("nats", "tls") and (parts.path not in ("", "/") or parts.query):
        raise _config_error(
            "servers",
            f"{where} {shown!r} must not have a path or query; use {scheme}://host:port",
        )
    host = parts.hostname
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    if port is None and scheme in ("nats", "tls"):
        port = 4222
    netloc = host if port is None else f"{host}:{port}"
    path = parts.path if scheme in ("ws", "wss") else ""
    clean = urlunsplit((scheme, netloc, path, parts.query, ""))
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return clean, user, password


#: a character no subject token may hold (wildcards, separators' neighbours, blanks)
_BAD_SUBJECT_CHARS = re.compile(r"[\s*>]")


def _subject_prefix(name: str, value: str, *, example: str) -> str:
    """``value`` checked as a subject prefix (dot-separated tokens, no wildcards, no blanks);
    one trailing dot is dropped (``JS.acc.API.`` is ``JS.acc.API``)."""
    text = value[:-1] if value.endswith(".") else value
    bad = _BAD_SUBJECT_CHARS.search(text)
    if bad is not None:
        what = "blanks" if bad.group().isspace() else "wildcards (* or >)"
        raise _config_error(
            name,
            f"{name} {value!r} is not a subject prefix: it holds {what}; give dot-separated "
            f"tokens without blanks or wildcards, e.g. {example}",
        )
    if any(token == "" for token in text.split(".")):
        raise _config_error(
            name,
            f"{name} {value!r} is not a subject prefix: it has an empty token (a leading "
            f"dot or two dots in a row); give dot-separated tokens, e.g. {example}",
        )
    return text


def _domain_name(name: str, value: str) -> str:
    """A JetStream domain: one subject token (it becomes ``$JS.<domain>.API``)."""
    if _BAD_SUBJECT_CHARS.search(value) or "." in value:
        raise _config_error(
            name,
            f"{name} {value!r} is not a JetStream domain name: a domain is one word without "
            "dots, blanks or wildcards (the domain set in the server's jetstream block, e.g. "
            "leaf or hub)",
        )
    return value


def _positive_float(name: str, value: Any, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _config_error(name, f"{name} must be a number of seconds, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise _config_error(name, f"{name} must be {bound} seconds, got {value!r}")
    return number


# ---------------------------------------------------------------------------- coercion


def _coerce(key: str, value: Any) -> Any:
    """Turn a mapping value (maybe a string from JSON/env) into the field's type."""
    if key == "servers":
        if isinstance(value, str):
            return tuple(s.strip() for s in value.split(",") if s.strip())
        if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise _config_error(
            "servers", "servers must be a list of URLs or a comma-separated string of URLs"
        )
    if key in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
            return False
        raise _config_error(key, f"{key} must be true or false, got {_type_hint(key, value)}")
    if key in _FLOAT_FIELDS:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _config_error(
                    key, f"{key} must be a number of seconds, got {_type_hint(key, value)}"
                ) from None
        return value
    if key in _INT_FIELDS:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise _config_error(
                    key, f"{key} must be an integer, got {_type_hint(key, value)}"
                ) from None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    if key in _FILE_FIELDS and isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _type_hint(key: str, value: Any) -> str:
    """Describe a bad value for a message: the value itself unless the key is secret."""
    if key in _SECRET_FIELDS:
        return f"a {type(value).__name__}"
    return repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
