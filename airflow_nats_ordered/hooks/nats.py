"""The ``nats`` connection type and :class:`NatsHook`.

An Airflow connection maps onto the one :class:`~airflow_nats_ordered.core.connection.connect.
ConnectionOptions` type; this module only translates field names (and writes credentials
given as *content* to private files, because NATS clients read them from files).

Connection fields (``airflow connections add nats_default --conn-type nats ...``):

======================  ============================================================
Host                    ``host`` or a comma list ``a:4222,b:4222`` or ``nats://a:4222,...``
                        (no credentials in URLs: Airflow shows Host in clear)
Port                    used for hosts without one (default 4222)
Login / Password        user + password authentication
extra ``servers``       a comma list of URLs (instead of Host/Port)
extra ``token``         token authentication (secret)
extra ``creds_secret``  a decentralized-auth ``.creds`` file's *content* (secret)
extra ``creds_file``    the path of a ``.creds`` file
extra ``nkey_seed_secret``  an nkey seed ``SU...`` (secret); ``nkey_seed_file``: its path
extra ``tls_ca``/``tls_cert``/``tls_private_key``  PEM content (the key is secret);
                        ``tls_ca_file``/``tls_cert_file``/``tls_key_file``: paths
extra ``tls_hostname``, ``tls_verify``, ``connect_timeout``, ``name``,
                        ``max_reconnect_attempts``, ``reconnect_time_wait``
extra ``inbox_prefix``  reply inbox prefix instead of ``_INBOX`` (a user allowed to
                        subscribe only to ``<prefix>.>``)
extra ``js_domain``     the JetStream domain (e.g. a leaf node's); or ``js_api_prefix``:
                        the JetStream API prefix instead of ``$JS.API`` (not both)
======================  ============================================================

Secret extras are named so that Airflow's secrets masker hides them in the REST API, the
UI and logs, and editing the connection in the UI keeps them (see
:mod:`.connection_secrets`). The former names ``creds``, ``nkey_seed`` and ``tls_key``
are refused, unread, with the rename to make: Airflow shows values under them in clear,
and puts a stored value back for the ``***`` the UI sends on Save only under names it
hides. Every secret value read is registered with the masker, so a log line that repeats
it shows ``***``.
Errors name the connection and the field to fix, never a secret; an operation the server
refused for want of a permission raises :class:`~..core.errors.PermissionDenied` naming the
permission, the connection and the field that gave its user.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from airflow.sdk import BaseHook

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import (
    ConfigError,
    ConnectError,
    NatsOrderedError,
    PermissionDenied,
    denial_in,
)
from airflow_nats_ordered.hooks.connection_secrets import (
    RENAMED_SECRET_EXTRAS,
    amask_secrets,
    check_no_former_names,
    check_no_url_credentials,
    mask_secrets,
    secret_values,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

#: extras whose value is file *content*, and the file option each becomes
CONTENT_FIELDS: Mapping[str, str] = {
    "creds_secret": "creds_file",
    "tls_ca": "tls_ca_file",
    "tls_cert": "tls_cert_file",
    "tls_private_key": "tls_key_file",
}
#: extras given to an option of another name
RENAMED_FIELDS: Mapping[str, str] = {"nkey_seed_secret": "nkey_seed"}
#: extras passed through under their own name
OPTION_FIELDS = (
    "servers",
    "token",
    "creds_file",
    "nkey_seed_file",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_hostname",
    "tls_verify",
    "connect_timeout",
    "name",
    "max_reconnect_attempts",
    "reconnect_time_wait",
    "inbox_prefix",
    "js_domain",
    "js_api_prefix",
)
#: how an option is named on the connection form, for error messages
_FORM_NAMES = {
    "servers": "Host/Port (or extra 'servers')",
    "user": "Login",
    "password": "Password",
    "inbox_prefix": "Inbox prefix (extra 'inbox_prefix')",
    "js_domain": "JetStream domain (extra 'js_domain')",
    "js_api_prefix": "JetStream API prefix (extra 'js_api_prefix')",
}
# hints in core messages written for CLI users: "(NATS_PASSWORD)", "(NATS_URL / --server)"
_ENV_HINT = re.compile(r"\s*\((?:or |from environment variable )?NATS_[A-Z_]+(?: / --[a-z-]+)?\)")


def _in_airflow_terms(conn_id: str, text: str) -> str:
    text = text.replace("the URL (NATS_URL / --server)", f"Host/Port of connection {conn_id!r}")
    return _ENV_HINT.sub("", text)


_secret_dir: str | None = None


def _private_file(content: str, suffix: str) -> str:
    """Write ``content`` to a file only this user can read, for the life of the process
    (a NATS client re-reads credentials on every reconnect). Same content, same file."""
    global _secret_dir
    if _secret_dir is None:
        _secret_dir = tempfile.mkdtemp(prefix="nats-ordered-conn-")  # mode 0700
        atexit.register(shutil.rmtree, _secret_dir, True)
    name = hashlib.sha256(content.encode()).hexdigest()[:24] + suffix
    path = os.path.join(_secret_dir, name)
    if not os.path.exists(path):
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(content if content.endswith("\n") else content + "\n")
        os.replace(path + ".tmp", path)
    return path


def _servers(host: str | None, port: int | None) -> str | None:
    if not host:
        return None
    out = []
    for part in (p.strip() for p in host.split(",")):
        if not part:
            continue
        if "://" not in part:
            part = f"nats://{part}" if ":" in part else f"nats://{part}:{port or 4222}"
        out.append(part)
    return ",".join(out) or None


def options_from_connection(
    conn_id: str,
    *,
    host: str | None,
    port: int | None,
    login: str | None,
    password: str | None,
    extra: Mapping[str, Any],
) -> ConnectionOptions:
    """The connection's fields as :class:`ConnectionOptions`; a ConfigError names the
    connection and the form field (or extra key) to fix. A secret under a former name of
    its extra is refused, unread, with the rename to make (see :mod:`.connection_secrets`)."""
    where = f"Airflow connection {conn_id!r}"
    check_no_former_names(where, extra)
    extras = {}
    for key, value in extra.items():
        # the UI may store form fields as extra__nats__<name>
        extras[key.removeprefix("extra__nats__")] = value
    for old in RENAMED_SECRET_EXTRAS:  # left blank by an older form: holds nothing
        if extras.get(old) in (None, ""):
            extras.pop(old, None)
    accepted = (*OPTION_FIELDS, *CONTENT_FIELDS, *RENAMED_FIELDS)
    unknown = sorted(k for k in extras if k not in accepted)
    if unknown:
        raise ConfigError(
            f"{where}: unknown extra field(s) {', '.join(unknown)}; accepted extra fields: "
            f"{', '.join(accepted)}"
        )
    opts: dict[str, Any] = {k: v for k, v in extras.items() if k in OPTION_FIELDS and v != ""}
    #: option -> the extra it came from, when the names differ (for error messages)
    origin: dict[str, str] = {}
    for key, option in RENAMED_FIELDS.items():
        if extras.get(key) not in (None, ""):
            opts[option] = extras[key]
            origin[option] = key
    for key, option in CONTENT_FIELDS.items():
        content = extras.get(key)
        if not content:
            continue
        if opts.get(option):
            raise ConfigError(
                f"{where}: both extra '{key}' (content) and extra '{option}' (a path) are "
                "set; set only one of them"
            )
        if not isinstance(content, str):
            raise ConfigError(f"{where}: extra '{key}' must be the file's text content")
        opts[option] = _private_file(content, ".creds" if option == "creds_file" else ".pem")
        origin[option] = key
    if host:
        check_no_url_credentials(where, "Host", host.split(","))
    if isinstance(opts.get("servers"), str | list | tuple):
        servers = opts["servers"]
        urls = servers.split(",") if isinstance(servers, str) else [str(u) for u in servers]
        check_no_url_credentials(where, "extra 'servers'", urls)
    from_host = _servers(host, port)
    if from_host and opts.get("servers"):
        raise ConfigError(
            f"{where}: both Host and extra 'servers' are set; use one of them for the URLs"
        )
    if from_host:
        opts["servers"] = from_host
    if login:
        opts["user"] = login
    if password:
        opts["password"] = password
    try:
        return ConnectionOptions.from_mapping(opts)
    except ConfigError as exc:
        field = getattr(exc, "field", None) or ""
        field = origin.get(field, field)
        form = _FORM_NAMES.get(field, f"extra '{field}'" if field else "a field")
        text = _in_airflow_terms(conn_id, str(exc))
        raise ConfigError(f"{where}, {form}: {text}") from None


def _credentials_field(options: ConnectionOptions) -> str:
    """The field of a ``nats`` connection that gave its user (no secret)."""
    method = options.auth_method
    if method == "user/password":
        return f"its Login {options.user!r}"
    if method == "creds":
        inside = _secret_dir is not None and str(options.creds_file).startswith(_secret_dir)
        return (
            "its extra 'creds_secret'"
            if inside
            else f"its extra 'creds_file' {options.creds_file!r}"
        )
    if method == "nkey":
        return (
            "its extra 'nkey_seed_file'"
            if options.nkey_seed_file
            else "its extra 'nkey_seed_secret'"
        )
    if method == "token":
        return "its extra 'token'"
    return "no credentials: neither its Login nor an extra creds_secret, creds_file, token or nkey"


def denial_in_airflow_terms(
    exc: BaseException, conn_id: str, options: ConnectionOptions
) -> PermissionDenied | None:
    """A :class:`PermissionDenied` behind ``exc`` worded for Airflow: the connection id
    and the field that gave the refused user. None if no permission was refused."""
    denied = denial_in(exc)
    if denied is None:
        return None
    fix = (
        "grant that user the permissions of the role this task acts in (`nats-ordered "
        "permissions --role publisher|worker|reader|operator|watcher --stream STREAM "
        "[--group GROUP]` prints each role's), or set the connection's credentials to a "
        "user that has them"
    )
    if denied.reply_inbox:
        fix += (
            "; or set the connection's Inbox prefix field (extra inbox_prefix) to a "
            "prefix whose PREFIX.> that user may subscribe to"
        )
    return denied.in_terms(
        f"the user of Airflow connection {conn_id!r} ({_credentials_field(options)})", fix
    )


class NatsHook(BaseHook):
    """Connects to NATS JetStream with an Airflow connection of type ``nats``.

    ``await hook.aget_options()`` / ``async with hook.aconnect() as nc`` for triggers (the
    connection is looked up with ``BaseHook.aget_connection``), ``hook.run(fn)`` for
    operators (runs ``await fn(nc)`` on a fresh event loop), ``test_connection()`` for the
    UI's Test button. The connection is read once per hook and cached.
    """

    conn_name_attr = "nats_conn_id"
    default_conn_name = "nats_default"
    conn_type = "nats"
    hook_name = "NATS JetStream"

    def __init__(self, nats_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nats_conn_id = nats_conn_id
        self._options: ConnectionOptions | None = None

    @staticmethod
    def options_of(
        conn_id: str, conn: Any, *, extra: Mapping[str, Any] | None = None, mask: bool = True
    ) -> ConnectionOptions:
        """The :class:`ConnectionOptions` of connection ``conn`` (an Airflow ``Connection``
        however it was looked up); a ConfigError names ``conn_id`` and the field to fix.
        Every secret value is registered with Airflow's secrets masker first (unless
        ``mask`` is false: the caller does it); a secret under a former extra name is
        refused, never registered. ``extra``: the connection's extras when the caller has
        already read them."""
        if extra is None:
            extra = conn.extra_dejson or {}
        if mask:
            mask_secrets(secret_values(conn.password, extra))
        return options_from_connection(
            conn_id,
            host=conn.host,
            port=conn.port,
            login=conn.login,
            password=conn.password,
            extra=extra,
        )

    def get_options(self) -> ConnectionOptions:
        if self._options is None:
            conn = self.get_connection(self.nats_conn_id)
            self._options = self.options_of(self.nats_conn_id, conn)
        return self._options

    async def aget_options(self) -> ConnectionOptions:
        if self._options is None:
            conn = await BaseHook.aget_connection(self.nats_conn_id)
            # aextra_dejson: the SDK's extra_dejson masks synchronously, unsafe in a trigger
            aextra = getattr(conn, "aextra_dejson", None)
            extra = (await aextra() if aextra else conn.extra_dejson) or {}
            await amask_secrets(secret_values(conn.password, extra))
            self._options = self.options_of(self.nats_conn_id, conn, extra=extra, mask=False)
        return self._options

    def get_conn(self) -> ConnectionOptions:
        """The connection as validated :class:`ConnectionOptions` (same as :meth:`get_options`).

        Airflow's convention is that ``get_conn()`` returns what talks to the service. A
        NATS client is asyncio and bound to the event loop it connected on, so a client
        returned from a sync method would be unusable (or leak) in the caller's loop; the
        settings are what can be handed around instead: servers, auth method and TLS,
        with ``password``/``token``/``nkey_seed`` hidden in ``repr()`` and
        :meth:`~ConnectionOptions.describe`. Connect with :meth:`aconnect` (a client on the
        running loop, closed on exit), :meth:`run` (sync: ``await fn(nc)`` on a fresh
        loop), or ``await core.connection.connect(hook.get_conn())`` on your own loop.
        The connection is read once and cached; every secret is registered with
        Airflow's secrets masker. A bad field raises ConfigError naming the connection
        and the field."""
        return self.get_options()

    @contextlib.asynccontextmanager
    async def aconnect(self, **nats_kwargs: Any) -> AsyncIterator[Any]:
        """A connected nats-py client, bound to the running loop, closed on exit."""
        options = await self.aget_options()
        nc = await connect(options, **nats_kwargs)
        try:
            yield nc
        except Exception as exc:
            # a refused permission names this connection and its credentials field
            denied = denial_in_airflow_terms(exc, self.nats_conn_id, options)
            if denied is None or denied is exc:
                raise
            raise denied from exc
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.drain(), 5)
            if not nc.is_closed:
                with contextlib.suppress(Exception):
                    await nc.close()

    def run(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Connect, ``await fn(nc)``, close: the sync facade operators use."""
        options = self.get_options()

        async def main() -> T:
            self._options = options
            async with self.aconnect() as nc:
                return await fn(nc)

        return asyncio.run(main())

    def test_connection(self) -> tuple[bool, str]:
        """Whether the server is reachable, accepts the credentials and has JetStream; a
        malformed connection (a former secret extra name among them) gets the error that
        says what to fix. Messages say "this connection", not its id: the api-server tests
        the UI's form under a random id of its own, which the user never saw."""
        try:
            options = self.get_options()

            async def probe(nc: Any) -> str:
                try:
                    info = await jetstream(nc, timeout=options.connect_timeout).account_info()
                except Exception as exc:
                    where = nc.connected_url.netloc if nc.connected_url else "?"
                    refused = str(getattr(nc, "last_error", None) or "").removeprefix("nats: ")
                    if "permissions violation for subscription" in refused.lower():
                        raise ConnectError(
                            f"connected to {where} as {options.auth_description()}, but the "
                            f"server refused the subscription to this client's reply subjects "
                            f"({refused}); set Inbox prefix (extra 'inbox_prefix') to a prefix "
                            "whose subjects (<prefix>.>) the user may subscribe to"
                        ) from None
                    api = ""
                    if options.js_domain is not None:
                        api = f" in JetStream domain {options.js_domain!r} (extra 'js_domain')"
                    elif options.js_api_prefix is not None:
                        api = (
                            f" under JetStream API prefix {options.js_api_prefix!r} "
                            "(extra 'js_api_prefix')"
                        )
                    raise ConnectError(
                        f"connected to {where} as {options.auth_description()}, but JetStream "
                        f"is not available to this account{api} ({type(exc).__name__}: {exc}); "
                        + (
                            "check the domain or prefix, "
                            if api
                            else "enable JetStream on the server (`-js`, or `jetstream {}` in "
                            "its config) or for the account"
                        )
                        + ("or that its server is reachable from this one" if api else "")
                    ) from None
                return (
                    f"connected to {', '.join(options.servers)} as "
                    f"{options.auth_description()}; JetStream is enabled "
                    f"({info.streams} streams, {info.consumers} consumers)"
                )

            return True, self.run(probe)
        except NatsOrderedError as exc:
            text = _in_airflow_terms(self.nats_conn_id, str(exc))
            text = text.replace(f"Airflow connection {self.nats_conn_id!r}", "This connection")
            return False, text.replace(f"of connection {self.nats_conn_id!r}", "of this connection")
        except Exception as exc:  # whatever else: the UI shows it, secrets redacted
            text = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                text = self.get_options().redact(text)
            return False, text
