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
malformed URI became another asset silently (``Asset("nats://")`` was ``nats:/``).
The servers and credentials are not part of the URI: they come from the watcher's or
operator's ``nats_conn_id`` connection.

Importing this module imports neither Airflow nor NATS.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlunsplit

__all__ = ["sanitize_uri"]

FORM = "nats://<STREAM>[/<path>], e.g. nats://ORDERS or nats://ORDERS_DLQ/billing"
#: what JetStream refuses in a stream name (the trigger's rule for its stream= too)
_NOT_IN_STREAM = re.compile(r"[.*>\s\\]")


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """Validate a ``nats`` asset URI (already normalised by Airflow) and return it.

    Raises ValueError for a URI without a stream, with credentials, with a server address
    (``host:port``) or with a stream name JetStream would refuse.
    """
    shown = urlunsplit(uri)
    stream = uri.netloc
    if not stream:
        first, _, rest = uri.path.lstrip("/").partition("/")
        hint = f"; did you mean nats://{first}{'/' + rest if rest else ''}?" if first else ""
        raise ValueError(
            f"nats asset URI names no stream (Airflow read it as {shown!r}): use {FORM}{hint}"
        )
    if "@" in stream:
        raise ValueError(
            f"nats asset URI {shown!r} must not hold credentials: use {FORM}; the "
            "credentials belong in the nats connection (nats_conn_id)"
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
