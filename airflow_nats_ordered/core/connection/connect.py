"""Opening a NATS connection: ``connect()`` and its clear first-connect errors.

:func:`connect` opens a nats-py client. The first connection attempt fails fast with a
named error (:class:`~..errors.ConnectError` or
:class:`~..errors.AuthError`) instead of nats-py's default of
retrying for minutes; once connected, nats-py's own reconnect logic rides out server
restarts. Connection events are logged on this module's logger
(``airflow_nats_ordered.core.connection.connect``).

How to reach NATS (servers, credentials, TLS, timeouts) is described by
:class:`~.options.ConnectionOptions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client

from airflow_nats_ordered.core.connection import denials
from airflow_nats_ordered.core.connection.api import remember_api_prefix
from airflow_nats_ordered.core.connection.credentials import _check_creds_file
from airflow_nats_ordered.core.connection.fields import (
    _AUTH_HINT,
    _strip_userinfo,
)
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import AuthError, ConfigError, ConnectError

__all__ = [
    "connect",
]

_log = logging.getLogger(__name__)

_URL_HINT = "Check the server is running and the URL (NATS_URL / --server)."


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
    "inbox_prefix": "inbox_prefix",
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
    ``disconnected_cb``, ``reconnected_cb``, ``closed_cb``); user callbacks run after
    this module's logging. Options that ConnectionOptions owns (servers, credentials, TLS,
    inbox prefix) are rejected with TypeError. The client remembers the options' JetStream
    API prefix (see :mod:`.api`: ``api.jetstream(nc)``).
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
    denials.install(nc)  # a refused request fails with PermissionDenied, not a timeout
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
        if denials.record(nc, exc) is not None:  # logged there, naming the permission
            if user_error_cb is not None:
                await user_error_cb(exc)
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
        if not nc.is_closed:  # reconnecting: what the old connection was refused is gone
            denials.forget(nc)
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
    remember_api_prefix(nc, options.api_prefix)
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
