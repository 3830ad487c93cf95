"""The subjects a client's JetStream API requests, KV writes and reply inboxes go to.

A client connected by :func:`~.connect.connect` remembers the JetStream API prefix of its
:class:`~.options.ConnectionOptions` (``$JS.API``, ``$JS.<js_domain>.API`` or
``js_api_prefix``); its inbox prefix is the one nats-py was connected with. Every part of
the core that talks to JetStream asks here instead of writing ``$JS.API`` or ``_INBOX``:

* :func:`jetstream` - ``nc.jetstream()`` for the client's API prefix;
* :func:`api_subject` - a raw API request subject (``api_subject(nc, "STREAM.INFO.S")``);
* :func:`kv_subject` - the subject a write to a KV key is published on;
* :func:`inbox_prefix` - the client's reply-inbox prefix (``_INBOX`` by default).

KV writes under a domain or API prefix
    nats-py's ``KeyValue`` writes to ``$KV.<bucket>.<key>``. A server with a leaf node in
    another JetStream domain denies ``$KV.>`` (with ``$JS.API.>``) across the leaf
    connection, and maps ``$JS.<domain>.API.$KV.>`` back to ``$KV.>`` in the domain the
    request is for, so a client of the hub writes a leaf's bucket through
    ``$JS.<domain>.API.$KV.<bucket>.<key>`` (as nats.go does for any API prefix but the
    default). :func:`jetstream` gives a context whose ``publish`` does that rewriting for
    ``$KV.`` and ``$OBJ.`` subjects, so ``KeyValue.put/create/update/delete/purge`` reach
    the bucket of the domain; reads (direct get, stream info, watchers) go through the API
    prefix already. With the default prefix nothing changes.

Clients made elsewhere (``nats.connect`` directly) get the defaults.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamInfo

__all__ = [
    "DEFAULT_API_PREFIX",
    "DEFAULT_INBOX_PREFIX",
    "api_prefix",
    "api_subject",
    "inbox_prefix",
    "jetstream",
    "kv_subject",
    "domain_api_prefix",
    "remember_api_prefix",
    "stream_infos",
    "write_subject",
]

DEFAULT_API_PREFIX = "$JS.API"
DEFAULT_INBOX_PREFIX = "_INBOX"

#: client -> the JetStream API prefix it was connected with (set by connect())
_API_PREFIXES: weakref.WeakKeyDictionary[Client, str] = weakref.WeakKeyDictionary()

#: the subject spaces of JetStream's materialised views, written through the API prefix
_VIEW_PREFIXES = ("$KV.", "$OBJ.")


def domain_api_prefix(domain: str | None) -> str:
    """The JetStream API prefix of JetStream ``domain``: ``$JS.<domain>.API``, or the
    default ``$JS.API`` for none."""
    return f"$JS.{domain}.API" if domain else DEFAULT_API_PREFIX


def remember_api_prefix(nc: Client, prefix: str) -> None:
    """Record that ``nc``'s JetStream API is at ``prefix`` (:func:`~.connect.connect` does)."""
    prefix = prefix[:-1] if prefix.endswith(".") else prefix
    if prefix == DEFAULT_API_PREFIX:
        _API_PREFIXES.pop(nc, None)
    else:
        _API_PREFIXES[nc] = prefix


def api_prefix(nc: Client) -> str:
    """The JetStream API prefix of ``nc``: ``$JS.API`` unless it was connected with a
    domain or API prefix."""
    return _API_PREFIXES.get(nc, DEFAULT_API_PREFIX)


def api_subject(nc: Client, rest: str) -> str:
    """The subject of JetStream API request ``rest`` (e.g. ``"STREAM.INFO.ORDERS"``) for
    ``nc``: ``$JS.API.STREAM.INFO.ORDERS``, or under the client's domain / API prefix."""
    return f"{api_prefix(nc)}.{rest}"


def kv_subject(nc: Client, bucket: str, key: str) -> str:
    """The subject a write to ``key`` of KV ``bucket`` is published on by ``nc``:
    ``$KV.<bucket>.<key>``, prefixed with the API prefix when it is not the default (see
    the module docstring). The key is stored under ``$KV.<bucket>.<key>`` either way."""
    return write_subject(api_prefix(nc), f"$KV.{bucket}.{key}")


def inbox_prefix(nc: Client) -> str:
    """The prefix of ``nc``'s reply inboxes (``_INBOX`` unless connected with another)."""
    raw = getattr(nc, "_inbox_prefix", None)
    if not raw:
        return DEFAULT_INBOX_PREFIX
    return bytes(raw).decode()


def jetstream(nc: Client, **kwargs: Any) -> JetStreamContext:
    """``nc.jetstream(**kwargs)`` for the API prefix ``nc`` was connected with (an explicit
    ``prefix`` or ``domain`` in ``kwargs`` wins). Under a prefix other than ``$JS.API`` the
    context also writes KV (and object store) keys through it (see the module docstring)."""
    if "prefix" in kwargs or "domain" in kwargs:
        return nc.jetstream(**kwargs)
    prefix = api_prefix(nc)
    if prefix == DEFAULT_API_PREFIX:
        return nc.jetstream(**kwargs)
    return _PrefixedJetStream(nc, prefix=prefix, **kwargs)


async def stream_infos(nc: Client) -> AsyncIterator[StreamInfo]:
    """Every stream of the account, as the JetStream API lists them a page at a time."""
    js = jetstream(nc)
    offset = 0
    while page := await js.streams_info(offset):
        offset += len(page)
        for info in page:
            yield info


def write_subject(prefix: str, subject: str) -> str:
    """Where a client with API prefix ``prefix`` publishes to ``subject``: a KV or object
    store write (``$KV.``/``$OBJ.``) goes through a prefix other than the default (see the
    module docstring), anything else to ``subject`` itself."""
    if prefix != DEFAULT_API_PREFIX and subject.startswith(_VIEW_PREFIXES):
        return f"{prefix}.{subject}"
    return subject


class _PrefixedJetStream(JetStreamContext):
    """A JetStream context under a non-default API prefix whose writes to ``$KV.``/``$OBJ.``
    subjects go through that prefix (nats.go's ``useJSPfx``)."""

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        return await super().publish(write_subject(self._prefix, subject), *args, **kwargs)

    async def publish_async(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        return await super().publish_async(write_subject(self._prefix, subject), *args, **kwargs)
