"""How to reach NATS: one options type for the CLI and the Airflow hook, and ``connect()``.

:class:`ConnectionOptions` holds servers, credentials and TLS settings; it validates
everything it can without a network (URL syntax, auth combinations, that files exist)
and never shows a secret in ``repr()``, :meth:`ConnectionOptions.describe`, log lines
or exception messages. Build it directly, from the environment variables of the
``nats`` CLI (:meth:`ConnectionOptions.from_env`), or from a dict such as Airflow
connection extras (:meth:`ConnectionOptions.from_mapping`).

:func:`connect` opens a nats-py client. The first connection attempt fails fast with a
named error (:class:`~airflow_nats_ordered.core.errors.ConnectError` or
:class:`~airflow_nats_ordered.core.errors.AuthError`) instead of nats-py's default of
retrying for minutes; once connected, nats-py's own reconnect logic rides out server
restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
import math
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
import nats.errors
from nats.aio.client import Client

from airflow_nats_ordered.core.errors import AuthError, ConfigError, ConnectError

__all__ = ["DEFAULT_SERVER", "ENV_VARS", "ConnectionOptions", "connect"]

_log = logging.getLogger(__name__)

DEFAULT_SERVER = "nats://127.0.0.1:4222"

#: Environment variable -> ConnectionOptions field. The names match the ``nats`` CLI.
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
}
_FIELD_TO_ENV = {v: k for k, v in ENV_VARS.items()}

_SCHEMES = ("nats", "tls", "ws", "wss")
_SECRET_FIELDS = ("password", "token", "nkey_seed")
_FILE_FIELDS = ("creds_file", "nkey_seed_file", "tls_ca_file", "tls_cert_file", "tls_key_file")
_OPTIONAL_STR_FIELDS = ("user", "password", "token", "nkey_seed", "tls_hostname", *_FILE_FIELDS)
_FLOAT_FIELDS = ("connect_timeout", "reconnect_time_wait", "ping_interval")
_INT_FIELDS = ("max_reconnect_attempts", "max_outstanding_pings")
_BOOL_FIELDS = ("tls_verify",)

_AUTH_HINT = (
    "set exactly one of: user + password (NATS_USER / NATS_PASSWORD), token (NATS_TOKEN), "
    "creds_file (NATS_CREDS) or nkey_seed_file / nkey_seed (NATS_NKEY)"
)
_URL_HINT = "Check the server is running and the URL (NATS_URL / --server)."


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


def _positive_float(name: str, value: Any, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _config_error(name, f"{name} must be a number of seconds, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise _config_error(name, f"{name} must be {bound} seconds, got {value!r}")
    return number


@dataclass(frozen=True)
class ConnectionOptions:
    """Where and how to connect to NATS. Immutable, validated, secret-safe.

    Guarantees after construction:

    * ``servers`` is a non-empty tuple of ``nats://``, ``tls://``, ``ws://`` or ``wss://``
      URLs with an explicit host (and port for nats/tls), without credentials: a
      ``user:password@`` or ``token@`` in a URL is moved into ``user``/``password``/
      ``token``. Websocket and non-websocket URLs are not mixed.
    * at most one auth method is set (user+password, token, creds file, nkey seed),
      and user/password come together; an nkey seed is a valid seed.
    * every file option names an existing file; a creds file has the JWT and seed blocks.
    * a TLS client certificate comes with its key.
    * ``password``, ``token`` and ``nkey_seed`` never appear in ``repr()``, ``str()`` or
      :meth:`describe` (shown as ``***`` when set).

    Invalid values raise :class:`~airflow_nats_ordered.core.errors.ConfigError` naming the
    option and how to fix it.

    ``max_reconnect_attempts`` counts attempts per server after the first successful
    connect: ``-1`` retries forever, ``0`` disables reconnecting. With the defaults
    (120 x 0.5 s) a client rides out about a minute of server downtime.
    ``ping_interval`` x ``max_outstanding_pings`` bounds how long a hung (not closed)
    server goes unnoticed.
    """

    servers: tuple[str, ...] = (DEFAULT_SERVER,)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    nkey_seed: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_hostname: str | None = None
    tls_verify: bool = True
    name: str = "nats-ordered"
    connect_timeout: float = 5.0
    reconnect_time_wait: float = 0.5
    max_reconnect_attempts: int = 120
    ping_interval: float = 20.0
    max_outstanding_pings: int = 3

    #: Option names accepted by :meth:`from_mapping` (all dataclass fields).
    FIELDS: ClassVar[tuple[str, ...]]

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        set_ = object.__setattr__

        # --- scalar types
        for name in _OPTIONAL_STR_FIELDS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike) and name in _FILE_FIELDS:
                value = os.fspath(value)
                set_(self, name, value)
            if value is not None and not isinstance(value, str):
                raise _config_error(name, f"{name} must be a string, got {type(value).__name__}")
            if isinstance(value, str) and value.strip() == "":
                set_(self, name, None)  # empty means unset (e.g. NATS_TOKEN="")
        if not isinstance(self.name, str) or not self.name.strip():
            raise _config_error("name", "name must be a non-empty string (the client name)")
        if not isinstance(self.tls_verify, bool):
            raise _config_error(
                "tls_verify",
                f"tls_verify must be true or false, got {type(self.tls_verify).__name__}",
            )
        set_(
            self,
            "connect_timeout",
            _positive_float("connect_timeout", self.connect_timeout, allow_zero=False),
        )
        set_(
            self,
            "reconnect_time_wait",
            _positive_float("reconnect_time_wait", self.reconnect_time_wait, allow_zero=True),
        )
        set_(
            self,
            "ping_interval",
            _positive_float("ping_interval", self.ping_interval, allow_zero=False),
        )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _config_error(name, f"{name} must be an integer, got {type(value).__name__}")
        if self.max_reconnect_attempts < -1:
            raise _config_error(
                "max_reconnect_attempts",
                "max_reconnect_attempts must be -1 (forever), 0 (never) or a positive count, "
                f"got {self.max_reconnect_attempts}",
            )
        if self.max_outstanding_pings < 1:
            raise _config_error(
                "max_outstanding_pings",
                f"max_outstanding_pings must be >= 1, got {self.max_outstanding_pings}",
            )

        # --- servers
        servers: Any = self.servers
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s.strip()]
        if not isinstance(servers, list | tuple) or not all(isinstance(s, str) for s in servers):
            raise _config_error(
                "servers", "servers must be a list of URLs or a comma-separated string of URLs"
            )
        if not servers:
            raise _config_error(
                "servers", f"servers is empty; give at least one URL such as {DEFAULT_SERVER}"
            )
        clean: list[str] = []
        url_creds: set[tuple[str | None, str | None]] = set()
        for i, url in enumerate(servers):
            normalized, url_user, url_password = _normalize_server(url, i)
            clean.append(normalized)
            if url_user is not None or url_password is not None:
                url_creds.add((url_user, url_password))
        schemes = {urlsplit(u).scheme for u in clean}
        if schemes & {"ws", "wss"} and schemes & {"nats", "tls"}:
            raise _config_error(
                "servers",
                "servers mix websocket (ws://, wss://) and non-websocket (nats://, tls://) URLs; "
                "use one kind for all servers",
            )
        set_(self, "servers", tuple(clean))
        if url_creds:
            self._absorb_url_credentials(url_creds)

        # --- auth combinations
        if self.user is not None and self.password is None:
            raise _config_error(
                "password",
                "user is set but password is not; set password (NATS_PASSWORD) too, "
                "or use token for token auth",
            )
        if self.password is not None and self.user is None:
            raise _config_error("user", "password is set but user is not; set user (NATS_USER) too")
        if self.nkey_seed is not None and self.nkey_seed_file is not None:
            raise _config_error(
                "nkey_seed",
                "both nkey_seed and nkey_seed_file are set; set only one of them",
            )
        methods = self._auth_methods()
        if len(methods) > 1:
            raise _config_error(
                methods[1],
                f"more than one auth method is set ({', '.join(methods)}); {_AUTH_HINT}",
            )

        # --- files
        for name in _FILE_FIELDS:
            path = getattr(self, name)
            if path is None:
                continue
            expanded = os.path.expanduser(path)
            set_(self, name, expanded)
            env = _FIELD_TO_ENV.get(name)
            hint = f" (or {env})" if env else ""
            if not os.path.exists(expanded):
                raise _config_error(
                    name, f"{name} file {expanded!r} does not exist; fix the path in {name}{hint}"
                )
            if not os.path.isfile(expanded):
                raise _config_error(
                    name, f"{name} {expanded!r} is not a regular file; fix the path in {name}{hint}"
                )
        if self.creds_file is not None:
            _check_creds_file(self.creds_file)
        if self.nkey_seed is not None:
            _check_seed(self.nkey_seed.strip().encode(), "nkey_seed", "nkey_seed")
        if self.nkey_seed_file is not None:
            _check_seed(
                _read_for_check(self.nkey_seed_file, "nkey_seed_file").strip(),
                "nkey_seed_file",
                f"nkey_seed_file {self.nkey_seed_file!r}",
            )

        # --- TLS
        if self.tls_cert_file is not None and self.tls_key_file is None:
            raise _config_error(
                "tls_key_file",
                "tls_cert_file is set but tls_key_file is not; set tls_key_file (NATS_KEY) "
                "to the client certificate's private key",
            )
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise _config_error(
                "tls_cert_file",
                "tls_key_file is set but tls_cert_file is not; set tls_cert_file (NATS_CERT) "
                "to the client certificate",
            )

    def _absorb_url_credentials(self, url_creds: set[tuple[str | None, str | None]]) -> None:
        """Move ``user:password@`` / ``token@`` from server URLs into the auth fields."""
        if len(url_creds) > 1:
            raise _config_error(
                "servers",
                "servers carry different credentials in their URLs; put credentials in "
                "user/password or token instead of the URLs",
            )
        url_user, url_password = next(iter(url_creds))
        if url_password is not None:
            target = {"user": url_user or "", "password": url_password}
        else:
            target = {"token": url_user or ""}
        for key, value in target.items():
            current = getattr(self, key)
            if current is not None and current != value:
                raise _config_error(
                    key,
                    f"{key} is set and a server URL also carries a different {key}; "
                    "remove the credentials from the URL",
                )
            object.__setattr__(self, key, value)

    def _auth_methods(self) -> list[str]:
        methods = []
        if self.user is not None or self.password is not None:
            methods.append("user")
        if self.token is not None:
            methods.append("token")
        if self.creds_file is not None:
            methods.append("creds_file")
        if self.nkey_seed is not None or self.nkey_seed_file is not None:
            methods.append("nkey_seed_file" if self.nkey_seed_file is not None else "nkey_seed")
        return methods

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> ConnectionOptions:
        """Build from a dict of option names (e.g. Airflow connection extras).

        Accepts strings for numbers and booleans (``"5"``, ``"true"``), ``servers`` as a
        list or a comma-separated string, and ``None`` for "not set". Unknown keys or
        values of the wrong type raise ConfigError naming the key.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"connection options must be a mapping of option names, got {type(d).__name__}"
            )
        unknown = sorted(str(k) for k in d if k not in cls.FIELDS)
        if unknown:
            raise ConfigError(
                f"unknown connection option(s): {', '.join(unknown)}; accepted options are: "
                f"{', '.join(cls.FIELDS)}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if value is None:
                continue
            kwargs[key] = _coerce(key, value)
        return cls(**kwargs)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides: Any) -> ConnectionOptions:
        """Build from the ``nats`` CLI's environment variables, then apply ``overrides``.

        Reads NATS_URL (comma-separated list allowed; default ``nats://127.0.0.1:4222``),
        NATS_USER, NATS_PASSWORD, NATS_TOKEN, NATS_CREDS, NATS_NKEY (seed file), NATS_CA,
        NATS_CERT and NATS_KEY. Empty variables count as unset. ``overrides`` are option
        names (as in :meth:`from_mapping`); overrides that are ``None`` are ignored, so
        unset CLI flags can be passed straight through. An override of one auth method
        replaces every auth method taken from the environment.
        """
        values: dict[str, Any] = {}
        from_env_vars: dict[str, str] = {}
        for var, name in ENV_VARS.items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[name] = raw
                from_env_vars[name] = var
        given = {k: v for k, v in overrides.items() if v is not None}
        auth_groups = (
            {"user", "password"},
            {"token"},
            {"creds_file"},
            {"nkey_seed_file", "nkey_seed"},
        )
        for group in auth_groups:
            if given.keys() & group:
                continue
            if any(given.keys() & other for other in auth_groups):
                for k in group:  # another auth method was chosen explicitly
                    values.pop(k, None)
                    from_env_vars.pop(k, None)
        for k in given:
            from_env_vars.pop(k, None)
        values.update(given)
        try:
            return cls.from_mapping(values)
        except ConfigError as exc:
            field_name = getattr(exc, "field", None)
            if field_name in from_env_vars:
                raise _config_error(
                    field_name, f"{exc} (from environment variable {from_env_vars[field_name]})"
                ) from None
            raise

    # ------------------------------------------------------------------ views
    @property
    def auth_method(self) -> str:
        """``none``, ``user/password``, ``token``, ``creds``, ``nkey`` (no secrets)."""
        methods = self._auth_methods()
        if not methods:
            return "none"
        return {
            "user": "user/password",
            "token": "token",
            "creds_file": "creds",
            "nkey_seed_file": "nkey",
            "nkey_seed": "nkey",
        }[methods[0]]

    @property
    def tls_required(self) -> bool:
        """True if TLS was asked for (tls/wss URL, any TLS file, tls_hostname, no verify).

        :func:`connect` then refuses a server that does not offer TLS.
        """
        return (
            any(urlsplit(u).scheme in ("tls", "wss") for u in self.servers)
            or any(
                v is not None
                for v in (
                    self.tls_ca_file,
                    self.tls_cert_file,
                    self.tls_key_file,
                    self.tls_hostname,
                )
            )
            or not self.tls_verify
        )

    def auth_description(self) -> str:
        """Which credentials are used, without secrets (e.g. ``user/password (user 'bob')``)."""
        method = self.auth_method
        if method == "user/password":
            return f"user/password (user {self.user!r})"
        if method == "creds":
            return f"creds file {self.creds_file!r}"
        if method == "nkey":
            source = (
                f"seed file {self.nkey_seed_file!r}"
                if self.nkey_seed_file is not None
                else "seed given inline"
            )
            return f"nkey ({source})"
        if method == "token":
            return "token"
        return "no credentials"

    def describe(self) -> str:
        """One line for logs and CLI output: servers, auth method, TLS. Never a secret."""
        tls = "off"
        if self.tls_required:
            bits = []
            if self.tls_ca_file:
                bits.append(f"ca={self.tls_ca_file}")
            if self.tls_cert_file:
                bits.append(f"cert={self.tls_cert_file}")
            if self.tls_hostname:
                bits.append(f"hostname={self.tls_hostname}")
            if not self.tls_verify:
                bits.append("verify=off")
            tls = "on" + (f" ({', '.join(bits)})" if bits else "")
        return f"{','.join(self.servers)} auth={self.auth_description()} tls={tls}"

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRET_FIELDS and value is not None:
                parts.append(f"{f.name}='***'")
            else:
                parts.append(f"{f.name}={value!r}")
        return f"ConnectionOptions({', '.join(parts)})"

    __str__ = __repr__

    # ------------------------------------------------------------------ nats-py
    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context, or None when no TLS option is set.

        Trusts ``tls_ca_file`` (else the system CAs), presents ``tls_cert_file`` /
        ``tls_key_file`` if set, and skips verification only if ``tls_verify`` is False.
        Raises ConfigError if a file cannot be loaded (wrong format, encrypted key).
        """
        if not self.tls_required:
            return None
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise _config_error(
                "tls_ca_file",
                f"tls_ca_file {self.tls_ca_file!r} could not be loaded as PEM CA certificates "
                f"({exc}); point tls_ca_file (NATS_CA) at the CA certificate in PEM format",
            ) from None
        if not self.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.tls_cert_file is not None and self.tls_key_file is not None:

            def refuse_password() -> str:
                raise _config_error(
                    "tls_key_file",
                    f"tls_key_file {self.tls_key_file!r} is encrypted; provide an unencrypted "
                    "PEM key (e.g. `openssl pkey -in key.pem -out key-plain.pem`)",
                )

            try:
                ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file, password=refuse_password)
            except ConfigError:
                raise
            except (ssl.SSLError, OSError) as exc:
                raise _config_error(
                    "tls_cert_file",
                    f"tls_cert_file {self.tls_cert_file!r} / tls_key_file {self.tls_key_file!r} "
                    f"could not be loaded ({exc}); they must be a PEM certificate and its "
                    "matching PEM private key",
                ) from None
        return ctx

    def nats_connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (contains secrets: never log this dict).

        Reconnect settings are those for after the first connect; :func:`connect` adds
        the fail-fast handling of the first attempt.
        """
        kwargs: dict[str, Any] = {
            "servers": list(self.servers),
            "name": self.name,
            "connect_timeout": self.connect_timeout,
            "reconnect_time_wait": self.reconnect_time_wait,
            "max_reconnect_attempts": self.max_reconnect_attempts,
            "ping_interval": self.ping_interval,
            "max_outstanding_pings": self.max_outstanding_pings,
            "allow_reconnect": True,
        }
        if self.user is not None:
            kwargs["user"] = self.user
            kwargs["password"] = self.password
        if self.token is not None:
            kwargs["token"] = self.token
        if self.creds_file is not None:
            kwargs["user_credentials"] = self.creds_file
        if self.nkey_seed_file is not None:
            kwargs["nkeys_seed"] = self.nkey_seed_file
        if self.nkey_seed is not None:
            kwargs["nkeys_seed_str"] = self.nkey_seed
        ctx = self.ssl_context()
        if ctx is not None:
            kwargs["tls"] = ctx
        if self.tls_hostname is not None:
            kwargs["tls_hostname"] = self.tls_hostname
        return kwargs

    def redact(self, text: str) -> str:
        """``text`` with every secret of these options replaced by ``***``."""
        for name in _SECRET_FIELDS:
            value = getattr(self, name)
            if value:
                text = text.replace(value, "***")
                if name == "nkey_seed":
                    text = text.replace(value.strip(), "***")
        return text


ConnectionOptions.FIELDS = tuple(f.name for f in dataclasses.fields(ConnectionOptions))


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


def _read_for_check(path: str, field_name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except OSError as exc:
        env = _FIELD_TO_ENV.get(field_name)
        hint = f" (or {env})" if env else ""
        raise _config_error(
            field_name,
            f"{field_name} {path!r} cannot be read ({exc.strerror}); fix the path or "
            f"permissions of {field_name}{hint}",
        ) from None


def _check_seed(seed: bytes, field_name: str, what: str) -> None:
    """Raise ConfigError (without the seed) unless ``seed`` is a valid nkey seed."""
    import nkeys

    try:
        kp = nkeys.from_seed(bytearray(seed))
        kp.wipe()
    except Exception:
        raise _config_error(
            field_name,
            f"{what} is not a valid NATS nkey seed (expected one line starting with 'SU', as "
            "written by `nsc` or `nk -gen user`)",
        ) from None


def _check_creds_file(path: str) -> None:
    """Raise ConfigError unless ``path`` looks like a NATS .creds file (JWT + seed blocks).

    nats-py loops forever on a creds file without the JWT marker, so this is checked
    before every connect.
    """
    content = _read_for_check(path, "creds_file")
    if b"BEGIN NATS USER JWT" not in content or b"BEGIN USER NKEY SEED" not in content:
        raise _config_error(
            "creds_file",
            f"creds_file {path!r} is not a NATS credentials file (it needs a "
            "'-----BEGIN NATS USER JWT-----' block and a '-----BEGIN USER NKEY SEED-----' "
            "block, as written by `nsc generate creds`)",
        )


# ---------------------------------------------------------------------------- connect

ErrorCallback = Callable[[Exception], Awaitable[None]]
Callback = Callable[[], Awaitable[None]]

_RESERVED_KWARGS = {
    "servers": "servers",
    "user": "user",
    "password": "password",
    "token": "token",
    "user_credentials": "creds_file",
    "nkeys_seed": "nkey_seed_file",
    "nkeys_seed_str": "nkey_seed",
    "tls": "tls_ca_file / tls_cert_file / tls_key_file / tls_verify",
    "tls_hostname": "tls_hostname",
}

_AUTH_MARKERS = (
    "authorization violation",
    "authentication timeout",
    "authentication expired",
    "authentication revoked",
    "account authentication expired",
    "user authentication expired",
)
_CLIENT_CERT_MARKERS = (
    "certificate required",
    "bad certificate",
    "unknown ca",
    "certificate unknown",
    "unsupported certificate",
    "certificate expired",
    "access denied",
)


#: Errors that mean "the connection is down"; logged once per outage.
_CONNECTION_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    nats.errors.StaleConnectionError,  # includes UnexpectedEOF
    nats.errors.ConnectionClosedError,
    nats.errors.NoServersError,
)


class _AbortFirstConnect(Exception):
    """Raised from our error callback to stop nats-py's retry loop on the first connect."""


def _is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, nats.errors.AuthorizationError):
        return True
    text = str(exc).lower()
    return isinstance(exc, nats.errors.Error) and any(m in text for m in _AUTH_MARKERS)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return str(exc.verify_message)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return re.sub(r"\s*\(_ssl\.c:\d+\)", "", str(exc)).strip() or type(exc).__name__
    text = str(exc).strip()
    if text.startswith("nats: "):
        text = text[len("nats: ") :]
    return text.strip("'") or type(exc).__name__


def _current_url(nc: Client) -> str | None:
    """Best effort: the URL nats-py was handshaking with (set before the handshake)."""
    server = getattr(nc, "_current_server", None)
    uri = getattr(server, "uri", None)
    if uri is None:
        return None
    try:
        return _strip_userinfo(uri.geturl())
    except Exception:  # pragma: no cover - defensive
        return None


def _transport_is_tls(nc: Client) -> bool | None:
    """True/False if the current TCP connection is/isn't TLS; None if unknown (websocket)."""
    transport = getattr(nc, "_transport", None)
    writer = getattr(transport, "_io_writer", None)
    if writer is None:
        return None
    return writer.get_extra_info("ssl_object") is not None


def _tls_error(opts: ConnectionOptions, url: str, exc: ssl.SSLError) -> ConnectError:
    reason = opts.redact(_reason(exc))
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ConnectError(
            f"TLS handshake with {url} failed: the server certificate was not accepted "
            f"({reason}). Set tls_ca_file (NATS_CA) to the CA that signed the server "
            "certificate, set tls_hostname if the certificate names another host, or (testing "
            "only) set tls_verify=False."
        )
    lowered = str(exc).lower()
    if any(m in lowered for m in _CLIENT_CERT_MARKERS):
        presented = (
            f"client certificate {opts.tls_cert_file!r} was presented"
            if opts.tls_cert_file
            else "no client certificate was presented"
        )
        return AuthError(
            f"TLS handshake with {url} failed: the server refused the client certificate "
            f"({reason}; {presented}). Set tls_cert_file and tls_key_file (NATS_CERT / NATS_KEY) "
            "to a client certificate signed by a CA the server trusts."
        )
    return ConnectError(
        f"TLS handshake with {url} failed ({reason}). Check tls_ca_file, tls_cert_file, "
        "tls_key_file, tls_hostname and that the server's tls block matches "
        "(NATS_CA / NATS_CERT / NATS_KEY)."
    )


def _auth_error(opts: ConnectionOptions, url: str, exc: BaseException) -> AuthError:
    reason = opts.redact(_reason(exc))
    if opts.auth_method == "none":
        fix = f"The server requires authentication but no credentials are configured; {_AUTH_HINT}."
    else:
        fixes = {
            "user/password": "Check user and password (NATS_USER / NATS_PASSWORD).",
            "token": "Check the token (NATS_TOKEN).",
            "creds": "Check the creds file (NATS_CREDS) belongs to an account this server "
            "trusts and has not expired or been revoked.",
            "nkey": "Check the nkey seed (NATS_NKEY) and that its public key is configured "
            "on the server.",
        }
        fix = fixes[opts.auth_method]
    return AuthError(
        f"NATS server {url} rejected the credentials ({reason}); auth method used: "
        f"{opts.auth_description()}. {fix}"
    )


@dataclass(frozen=True)
class _Failure:
    """One failed attempt of the first connect."""

    url: str | None  # known when the server had answered (INFO received)
    exc: BaseException
    server_info: Mapping[str, Any] | None  # the INFO of this attempt, if any


def _client_cert_refused(opts: ConnectionOptions, failure: _Failure) -> AuthError | None:
    """An AuthError if the server (INFO ``tls_verify``) dropped us during the TLS handshake.

    With TLS 1.3 the server checks the client certificate after the client's handshake
    finished, so the client often sees a broken pipe or reset instead of the TLS alert.
    """
    info = failure.server_info or {}
    exc = failure.exc
    if not info.get("tls_verify") or isinstance(exc, ssl.SSLError):
        return None
    if not isinstance(exc, OSError | nats.errors.StaleConnectionError) or isinstance(
        exc, ConnectionRefusedError | TimeoutError
    ):
        return None
    url = failure.url or ", ".join(opts.servers)
    if opts.tls_cert_file is None:
        return AuthError(
            f"TLS handshake with {url} failed: the server requires a client certificate "
            f"(its tls block has verify: true) and none was configured "
            f"({opts.redact(_reason(exc))}). Set tls_cert_file and tls_key_file "
            "(NATS_CERT / NATS_KEY) to a client certificate signed by a CA the server trusts."
        )
    return AuthError(
        f"TLS handshake with {url} failed: the server closed the connection after receiving "
        f"client certificate {opts.tls_cert_file!r} ({opts.redact(_reason(exc))}); it was "
        "probably not signed by a CA the server trusts. Set tls_cert_file and tls_key_file "
        "(NATS_CERT / NATS_KEY) to a client certificate the server accepts."
    )


def _first_connect_error(opts: ConnectionOptions, failures: list[_Failure]) -> ConnectError:
    """Turn the failures of the first connect attempt into one named, secret-free error."""
    all_urls = ", ".join(opts.servers)
    for failure in reversed(failures):  # the decisive error is the last one
        if _is_auth_error(failure.exc):
            return _auth_error(opts, failure.url or all_urls, failure.exc)
        if isinstance(failure.exc, ssl.SSLError):
            return _tls_error(opts, failure.url or all_urls, failure.exc)
        refused = _client_cert_refused(opts, failure)
        if refused is not None:
            return refused
    target = opts.servers[0] if len(opts.servers) == 1 else f"any of {all_urls}"
    reasons = (
        "; ".join(
            dict.fromkeys(
                opts.redact(f"{f.url + ': ' if f.url else ''}{_reason(f.exc)}") for f in failures
            )
        )
        or "no reason reported"
    )
    return ConnectError(
        f"could not connect to {target} within {opts.connect_timeout!r}s: {reasons}. {_URL_HINT}"
    )


async def connect(options: ConnectionOptions, **extra_nats_kwargs: Any) -> Client:
    """Connect to NATS with ``options`` and return a connected nats-py client.

    The first connect tries each configured server once (each attempt bounded by
    ``connect_timeout``) and then fails with a named error instead of retrying:

    * :class:`AuthError` if the server rejected the credentials (names the auth method,
      never the secret) or refused the TLS client certificate;
    * :class:`ConnectError` if no server could be reached ("could not connect to URL
      within Ns: reason"), the TLS handshake failed, or TLS was asked for (see
      :attr:`ConnectionOptions.tls_required`) but the server does not offer it.

    After the first successful connect, nats-py reconnects on its own using
    ``reconnect_time_wait`` and ``max_reconnect_attempts`` (subscriptions are
    re-established; publishes are buffered meanwhile). Connection events are logged on
    this module's logger, with secrets redacted. A reconnect that lands on a non-TLS
    server while TLS is required closes the client.

    ``extra_nats_kwargs`` are passed to ``nats.connect`` (e.g. ``error_cb``,
    ``disconnected_cb``, ``reconnected_cb``, ``closed_cb``, ``inbox_prefix``); user
    callbacks run after this module's logging. Options that ConnectionOptions owns
    (servers, credentials, TLS) are rejected with TypeError.
    """
    if not isinstance(options, ConnectionOptions):
        raise TypeError(f"connect() needs ConnectionOptions, got {type(options).__name__}")
    clash = sorted(k for k in extra_nats_kwargs if k in _RESERVED_KWARGS)
    if clash:
        raise TypeError(
            "connect() got option(s) that ConnectionOptions controls: "
            + ", ".join(f"{k} (set ConnectionOptions.{_RESERVED_KWARGS[k]})" for k in clash)
        )
    if any(urlsplit(u).scheme in ("ws", "wss") for u in options.servers) and (
        importlib.util.find_spec("aiohttp") is None
    ):
        raise ConfigError(
            "ws:// and wss:// servers need the aiohttp package; `pip install aiohttp` "
            "or use nats:// / tls:// URLs"
        )
    if options.creds_file is not None:
        _check_creds_file(options.creds_file)  # nats-py hangs on a malformed file

    user_error_cb: ErrorCallback | None = extra_nats_kwargs.pop("error_cb", None)
    user_disconnected_cb: Callback | None = extra_nats_kwargs.pop("disconnected_cb", None)
    user_reconnected_cb: Callback | None = extra_nats_kwargs.pop("reconnected_cb", None)
    user_closed_cb: Callback | None = extra_nats_kwargs.pop("closed_cb", None)

    nc = Client()
    first_connect = True
    failures: list[_Failure] = []
    closing: list[asyncio.Task[None]] = []  # keeps close tasks referenced until done
    outage_logged = False  # one WARNING per outage; further reconnect errors at DEBUG
    # nats-py stores each server INFO as a new dict: a new object means this attempt got
    # as far as the handshake, so _current_server is the server that failed.
    last_info: object = getattr(nc, "_server_info", None)

    async def error_cb(exc: Exception) -> None:
        nonlocal outage_logged, last_info
        if first_connect:
            info = getattr(nc, "_server_info", None)
            fresh = info if info is not last_info and isinstance(info, dict) and info else None
            last_info = info
            url = _current_url(nc) if fresh is not None else None
            failures.append(_Failure(url, exc, fresh))
            if (
                _is_auth_error(exc)
                or isinstance(exc, ssl.SSLError)  # nats-py can hang retrying after these
                or len(failures) >= len(options.servers)
            ):
                raise _AbortFirstConnect
            return
        level = logging.WARNING
        if nc.is_reconnecting or isinstance(exc, _CONNECTION_ERRORS):
            if outage_logged:
                level = logging.DEBUG
            outage_logged = True
        _log.log(level, "NATS connection error: %s", options.redact(_reason(exc)))
        if user_error_cb is not None:
            await user_error_cb(exc)

    async def disconnected_cb() -> None:
        if first_connect:
            return
        if nc.is_closed or options.max_reconnect_attempts == 0:
            _log.log(
                logging.DEBUG if nc.is_closed else logging.WARNING,
                "disconnected from NATS (connection closed; reconnect %s)",
                "disabled" if options.max_reconnect_attempts == 0 else "not attempted",
            )
        else:
            _log.warning("disconnected from NATS; reconnecting (%s)", _reconnect_policy(options))
        if user_disconnected_cb is not None:
            await user_disconnected_cb()

    async def reconnected_cb() -> None:
        nonlocal outage_logged
        outage_logged = False
        url = _current_url(nc) or "NATS"
        if options.tls_required and _transport_is_tls(nc) is False:
            _log.error(
                "reconnected to %s without TLS although TLS is required; closing the connection",
                url,
            )
            # close from a separate task: we are running inside nats-py's reconnect task
            closing.append(asyncio.get_running_loop().create_task(_close_quietly(nc)))
            return
        _log.info("reconnected to %s", url)
        if user_reconnected_cb is not None:
            await user_reconnected_cb()

    async def closed_cb() -> None:
        if not first_connect:
            _log.debug("NATS connection closed")
            if user_closed_cb is not None:
                await user_closed_cb()

    kwargs = options.nats_connect_kwargs()
    kwargs.update(extra_nats_kwargs)
    # Safety net only: each attempt is bounded by connect_timeout (TCP, INFO, TLS, PONG).
    overall = options.connect_timeout * 3 * len(options.servers) + 1.0
    try:
        async with asyncio.timeout(overall):
            await nc.connect(
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                closed_cb=closed_cb,
                **kwargs,
            )
    except _AbortFirstConnect:
        # after a failed TLS handshake nats-py's close() never finishes: don't wait long
        tls_failed = any(
            isinstance(f.exc, ssl.SSLError) or (f.server_info or {}).get("tls_required")
            for f in failures
        )
        await _close_quietly(nc, timeout=0.05 if tls_failed else 0.5)
        raise _first_connect_error(options, failures) from None
    except TimeoutError:
        await _close_quietly(nc)
        if failures:
            raise _first_connect_error(options, failures) from None
        raise ConnectError(
            f"could not connect to {', '.join(options.servers)}: no answer within "
            f"{overall!r}s. {_URL_HINT}"
        ) from None
    except (nats.errors.Error, OSError) as exc:  # e.g. NoServersError, bare socket errors
        await _close_quietly(nc)
        failures.append(_Failure(None, exc, None))
        raise _first_connect_error(options, failures) from None
    except BaseException:
        await _close_quietly(nc)
        raise

    if not nc.is_connected:  # pragma: no cover - defensive; nats-py returned half-open
        await _close_quietly(nc)
        fallback = [_Failure(None, ConnectionError("not connected"), None)]
        raise _first_connect_error(options, failures or fallback)
    url = _current_url(nc) or options.servers[0]
    if options.tls_required and _transport_is_tls(nc) is False:
        await _close_quietly(nc)
        raise ConnectError(
            f"TLS was requested (tls:// URL or tls_* options) but the server at {url} does not "
            "offer TLS; enable TLS on the server (a tls {} block) or remove the TLS options "
            "and use a nats:// URL."
        )
    first_connect = False
    if options.max_reconnect_attempts == 0:
        nc.options["allow_reconnect"] = False
    _log.info("connected to %s as %r (%s)", url, options.name, options.auth_description())
    return nc


def _reconnect_policy(options: ConnectionOptions) -> str:
    if options.max_reconnect_attempts == 0:
        return "reconnect disabled"
    if options.max_reconnect_attempts < 0:
        attempts = "forever"
    else:
        attempts = f"up to {options.max_reconnect_attempts} attempts per server"
    return f"{attempts}, every {options.reconnect_time_wait:g}s"


async def _close_quietly(nc: Client, timeout: float = 0.5) -> None:
    """Close ``nc`` ignoring errors; abort its sockets if closing hangs.

    nats-py's ``close()`` waits forever on a stream whose TLS handshake failed, so the
    close is bounded and the underlying transports are aborted afterwards.
    """
    try:
        async with asyncio.timeout(timeout):
            await nc.close()
    except Exception:  # noqa: BLE001 - best effort; TimeoutError included
        pass
    transport = getattr(nc, "_transport", None)
    for attr in ("_io_writer", "_bare_io_writer"):
        writer = getattr(transport, attr, None)
        raw = getattr(writer, "transport", None)
        if raw is not None and not raw.is_closing():
            with contextlib.suppress(Exception):
                raw.abort()
