"""``ConnectionOptions``: the one description of how to reach NATS, for the CLI and Airflow.

:class:`ConnectionOptions` holds servers, credentials and TLS settings; it validates
everything it can without a network (URL syntax, auth combinations, that files exist)
and never shows a secret in ``repr()``, :meth:`ConnectionOptions.describe`, log lines
or exception messages. Build it directly, from the environment variables of the
``nats`` CLI (:meth:`ConnectionOptions.from_env`), or from a dict such as Airflow
connection extras (:meth:`ConnectionOptions.from_mapping`).

Option names, environment variables and the parsing of single values live in
:mod:`~.fields`; checks of creds files and nkey seeds
in :mod:`~.credentials`. Import it from here
(or, as a user, from :mod:`airflow_nats_ordered.core`).
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from airflow_nats_ordered.core.connection.api import domain_api_prefix
from airflow_nats_ordered.core.connection.credentials import (
    _check_creds_file,
    _check_seed,
    _read_for_check,
)
from airflow_nats_ordered.core.connection.fields import (
    _AUTH_HINT,
    _FIELD_TO_ENV,
    _FILE_FIELDS,
    _INT_FIELDS,
    _OPTIONAL_STR_FIELDS,
    _SECRET_FIELDS,
    DEFAULT_SERVER,
    ENV_VARS,
    _coerce,
    _config_error,
    _domain_name,
    _normalize_server,
    _positive_float,
    _subject_prefix,
)
from airflow_nats_ordered.core.errors import ConfigError

__all__ = ["ConnectionOptions"]


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

    Invalid values raise :class:`~..errors.ConfigError` naming the
    option and how to fix it.

    ``max_reconnect_attempts`` counts attempts per server after the first successful
    connect: ``-1`` retries forever, ``0`` disables reconnecting. With the defaults
    (120 x 0.5 s) a client rides out about a minute of server downtime.
    ``ping_interval`` x ``max_outstanding_pings`` bounds how long a hung (not closed)
    server goes unnoticed.

    ``inbox_prefix`` replaces ``_INBOX`` in every reply subject the client makes (for a user
    allowed to subscribe only to, say, ``_MYINBOX.>``). ``js_domain`` (the JetStream of that
    domain, API prefix ``$JS.<domain>.API``, e.g. a leaf node's) or ``js_api_prefix`` (an
    API imported from another account under a prefix) directs every JetStream API request,
    and the writes to the group's KV buckets, there (:attr:`api_prefix`); at most one of the
    two. All three are checked as subject prefixes (dot-separated tokens, no wildcards or
    blanks; a domain is one token).
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
    inbox_prefix: str | None = None
    js_domain: str | None = None
    js_api_prefix: str | None = None

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

        # --- subjects: the reply inbox and the JetStream API
        if self.inbox_prefix is not None:
            set_(
                self,
                "inbox_prefix",
                _subject_prefix("inbox_prefix", self.inbox_prefix, example="_INBOX_ORDERS"),
            )
        if self.js_domain is not None and self.js_api_prefix is not None:
            raise _config_error(
                "js_api_prefix",
                "both js_domain and js_api_prefix are set; set only one of them (a domain "
                "means the API prefix $JS.<domain>.API)",
            )
        if self.js_domain is not None:
            set_(self, "js_domain", _domain_name("js_domain", self.js_domain))
        if self.js_api_prefix is not None:
            set_(
                self,
                "js_api_prefix",
                _subject_prefix("js_api_prefix", self.js_api_prefix, example="JS.hub.API"),
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
        NATS_CERT and NATS_KEY, and NATS_INBOX_PREFIX, NATS_JS_DOMAIN and NATS_JS_API_PREFIX
        (the ``nats`` CLI's ``--inbox-prefix``, ``--js-domain`` and ``--js-api-prefix``).
        Empty variables count as unset. ``overrides`` are option
        names (as in :meth:`from_mapping`); overrides that are ``None`` are ignored, so
        unset CLI flags can be passed straight through. An override of one auth method
        replaces every auth method taken from the environment, and one of js_domain /
        js_api_prefix replaces both.
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
        if given.keys() & {"js_domain", "js_api_prefix"}:  # one replaces the other
            for k in ("js_domain", "js_api_prefix"):
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

    @property
    def api_prefix(self) -> str:
        """The JetStream API prefix requests go to: ``js_api_prefix``, ``$JS.<js_domain>.API``,
        or ``$JS.API`` when neither is set."""
        if self.js_api_prefix is not None:
            return self.js_api_prefix
        return domain_api_prefix(self.js_domain)

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
        """One line for logs and CLI output: servers, auth method, TLS, and the inbox prefix
        and JetStream domain or API prefix when set. Never a secret."""
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
        text = f"{','.join(self.servers)} auth={self.auth_description()} tls={tls}"
        for name in ("inbox_prefix", "js_domain", "js_api_prefix"):
            value = getattr(self, name)
            if value is not None:
                text += f" {name}={value}"
        return text

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
        if self.inbox_prefix is not None:
            kwargs["inbox_prefix"] = self.inbox_prefix
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
