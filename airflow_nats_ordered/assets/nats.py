"""The ``nats://`` asset URI: ``nats://<STREAM>[/<path>]``, a JetStream stream.

Registered as the provider's ``asset-uris`` handler for the ``nats`` scheme, so Airflow
calls :func:`sanitize_uri` whenever an ``Asset("nats://...")`` is created (in a DAG file,
at parse time) after its own generic normalisation (scheme lower-cased, password dropped
with a warning, trailing slashes removed, an empty path made ``/``, query sorted, fragment
dropped).

Guaranteed: a URI this accepts names a stream (the netloc, case kept: stream names are
case-sensitive) that JetStream could hold: non-empty, without ``.``, ``*``, ``>``,
whitespace or backslash. The path is free (e.g. the group or subject the asset is about,
``nats://ORDERS_DLQ/billing``) and kept as Airflow normalised it, so an asset's identity
does not change: ``nats://ORDERS`` is ``nats://ORDERS/``, as before this handler.
Anything else raises ValueError saying what is wrong and the form to use: before, a
malformed URI became another asset silently (``Asset("nats://")`` was ``nats:/``), and
``nats://alice:pw@ORDERS`` only made Airflow warn (it kept the password in the asset's
name). No error message repeats a user or password.
The servers and credentials are not part of the URI: they come from the watcher's or
operator's ``nats_conn_id`` connection.

Importing this module imports neither Airflow nor NATS.
"""

from __future__ import annotations

import re
import sys
from urllib.parse import SplitResult, urlsplit, urlunsplit

__all__ = ["sanitize_uri"]

FORM = "nats://<STREAM>[/<path>], e.g. nats://ORDERS or nats://ORDERS_DLQ/billing"
#: what JetStream refuses in a stream name (the trigger's rule for its stream= too)
_NOT_IN_STREAM = re.compile(r"[.*>\s\\]")


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """Validate a ``nats`` asset URI (already normalised by Airflow) and return it.

    Raises ValueError for a URI without a stream, with credentials (a user, or a user and
    password, which Airflow drops from the URI before this is called, see
    :func:`_as_written`), with a server address (``host:port``) or with a stream name
    JetStream would refuse. No message repeats a user or password.
    """
    stream = uri.netloc.rpartition("@")[2]
    shown = urlunsplit(uri._replace(netloc=stream))
    user, password = _credentials(_as_written(), uri)
    if user or password:
        held = "a user and a password" if password else "a user name"
        raise ValueError(
            f"nats asset URI {shown!r} must not hold credentials (it held {held}, which "
            "Airflow would keep in the asset's name, shown in the UI and the REST API): use "
            f"{FORM}; the credentials belong in the nats connection (nats_conn_id)"
        )
    stream = uri.netloc
    if not stream:
        first, _, rest = uri.path.lstrip("/").partition("/")
        hint = f"; did you mean nats://{first}{'/' + rest if rest else ''}?" if first else ""
        raise ValueError(
            f"nats asset URI names no stream (Airflow read it as {shown!r}): use {FORM}{hint}"
        )
    if ":" in stream:
        raise ValueError(
            f"nats asset URI {shown!r} names a server address, not a stream: use {FORM}; "
            "the servers come from the nats connection (nats_conn_id)"
        )
    if _NOT_IN_STREAM.search(stream):
        raise ValueError(
            f"nats asset URI {shown!r}: {stream!r} is not a JetStream stream name (no '.', "
            f"'*', '>', whitespace or backslash); use {FORM}"
        )
    return uri


def _as_written() -> str | None:
    """The URI as the DAG file wrote it, or None when Airflow did not call from there.

    Airflow (3.3, ``airflow.sdk.definitions.asset._sanitize_uri``) drops the user info of
    a URI that holds a password, with only a warning, before it calls this handler; the
    asset keeps the URI as written as its *name* (password included, stored in the metadata
    DB and shown by the UI). The handler gets only the result, so the original is read
    from that caller's ``uri`` local. Another Airflow version without it: None (a user
    without a password is still seen in the normalised URI);
    tests/airflow/test_airflow_asset_uri.py fails if the caller changes."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "_sanitize_uri" and frame.f_globals.get("__name__", "").startswith(
            "airflow."
        ):
            given = frame.f_locals.get("uri")
            return given if isinstance(given, str) else None
    return None


def _credentials(given: str | None, uri: SplitResult) -> tuple[str | None, str | None]:
    """``(user, password)`` of the URI as written (else of the normalised one, which keeps
    a user given without a password)."""
    for candidate in (given, urlunsplit(uri)):
        if candidate:
            try:
                parts = urlsplit(candidate)
                user, password = parts.username, parts.password
            except ValueError:  # e.g. a bad port: the checks below say what is wrong
                continue
            if user or password:
                return user, password
    return None, None
