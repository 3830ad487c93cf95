"""Named errors. Every message says what was wrong and how to fix it."""

from __future__ import annotations

from typing import Any


class NatsOrderedError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(NatsOrderedError, ValueError):
    """A setting, flag, connection extra or record is malformed."""


class ConnectError(NatsOrderedError):
    """The NATS servers could not be reached, or refused the connection."""


class AuthError(ConnectError):
    """The server rejected the credentials (user/password, token, creds, nkey) or TLS."""


class PermissionDenied(NatsOrderedError):
    """The NATS server refused an operation: the user this client connected as may not
    ``operation`` (``"publish"`` or ``"subscribe"``) to ``subject``. The server drops what
    it refuses and tells only the client's error callback, so without this error the
    operation would just time out (see :mod:`~.connection.denials`).

    ``subject`` is the subject the server named (``grant``: the subject to allow, which
    for a reply inbox is the whole inbox prefix, e.g. ``_INBOX.>``). ``str(exc)`` names
    the permission in the core's terms; an adapter words who connected and how to fix it
    in its own with ``exc.message_for("the user given by --creds", "run ...")``, or
    :meth:`in_terms` for an error to raise in them.
    """

    def __init__(
        self,
        operation: str,
        subject: str,
        hint: str | None = None,
        *,
        grant: str | None = None,
        user: str | None = None,
    ) -> None:
        if operation not in ("publish", "subscribe"):
            raise ValueError(f"operation must be 'publish' or 'subscribe', got {operation!r}")
        #: ``"publish"`` or ``"subscribe"``
        self.operation = operation
        #: the subject the server refused
        self.subject = subject
        #: the subject (or wildcard) to allow so that the operation passes
        self.grant = grant or subject
        #: who was refused: how the interface in use gave the credentials
        self.user = user or "the NATS user this client connected as"
        #: what to do about it, in the core's terms (or the interface's)
        self.hint = hint or (
            "allow it for that user (`nats-ordered permissions --role ROLE --stream STREAM` "
            "prints what each role needs) or connect as a user that has it"
        )
        super().__init__(self.message_for(self.user, self.hint))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (a Spark task's error)
        return (
            _permission_denied,
            (self.operation, self.subject, self.hint, self.grant, self.user),
        )

    def in_terms(self, user: str, fix: str) -> PermissionDenied:
        """The same refusal worded for an interface: ``user`` says how the credentials were
        given (a flag, a connection field), ``fix`` what to do there."""
        return PermissionDenied(self.operation, self.subject, fix, grant=self.grant, user=user)

    @property
    def permission(self) -> str:
        """The missing permission, e.g. ``publish to $KV.b.k`` (with the grant when it is
        wider than the subject: ``subscribe to _INBOX.x.* (allow _INBOX.>)``)."""
        text = f"{self.operation} to {self.subject}"
        return text if self.grant == self.subject else f"{text} (allow {self.grant})"

    @property
    def reply_inbox(self) -> bool:
        """Whether the refused subscription is the client's reply inbox (every request's
        answers arrive there): the user needs its inbox prefix, or another prefix."""
        return self.operation == "subscribe" and self.grant != self.subject

    def message_for(self, user: str | None = None, fix: str | None = None) -> str:
        """The refusal, naming ``user`` (how the interface gave the credentials; default
        :attr:`user`) and ``fix`` (what to do, in its terms; default: :attr:`hint`)."""
        return f"permission denied: {self.permission} for {user or self.user}; {fix or self.hint}"


def _permission_denied(
    operation: str, subject: str, hint: str, grant: str, user: str
) -> PermissionDenied:
    return PermissionDenied(operation, subject, hint, grant=grant, user=user)


class StreamNotFoundError(NatsOrderedError):
    """The partitioned stream does not exist."""


class StreamConflictError(NatsOrderedError):
    """An existing stream differs from the request in a way that cannot be changed in place."""


class PartitionMismatchError(StreamConflictError):
    """The partition count the caller expected differs from the stream's metadata."""


class RecordError(NatsOrderedError, ValueError):
    """One record was refused before sending (no key, payload too large). Nothing was sent."""


class MissingKeyError(RecordError):
    """A record has no key and keyless round-robin was not asked for."""


class RecordTooLargeError(RecordError):
    """A record is larger than the server's max_payload."""


class InvalidKeyError(RecordError):
    """A record's key cannot be sent: not text (invalid UTF-8, a lone surrogate), or longer
    than :data:`~.stream.keys.MAX_KEY_BYTES` bytes in UTF-8. Nothing was sent.

    ``str(exc)`` names the Python parameter (``key ...``); an adapter words the same refusal
    in its terms with ``exc.message_for("--key-field 'tailnum' value")``.
    """

    def __init__(self, detail: str, name: str = "key") -> None:
        #: the quoted key and what is wrong with it, without the name of the field
        self.detail = detail
        super().__init__(self.message_for(name))

    def message_for(self, name: str) -> str:
        """The refusal, naming ``name`` (a parameter, flag or column) as what to fix."""
        return f"{name} {self.detail}"


class KeyTextError(ConfigError):
    """A record field's value has no canonical key text (a float, decimal, boolean,
    object, array, date or timestamp), or its text cannot be a key (invalid UTF-8, a lone
    surrogate, over 4096 UTF-8 bytes): see :func:`~.stream.keys.key_text`.

    ``str(exc)`` names a Python parameter (``key_field value ...``); an adapter words it in
    its terms with ``exc.message_for("line 3: --key-field 'k' value")``."""

    def __init__(self, detail: str, name: str = "key_field value") -> None:
        #: the quoted value and what is wrong with it, without the name of the field
        self.detail = detail
        super().__init__(self.message_for(name))

    def message_for(self, name: str) -> str:
        """The refusal, naming ``name`` (a flag, parameter or column) as what to fix."""
        return f"{name} {self.detail}"


class KeyEncodingError(NatsOrderedError, ValueError):
    """A received record's key headers cannot be decoded (invalid base64 or UTF-8 in
    ``Nats-Ordered-Key-B64``, or both key headers set). A worker treats the record as a
    poison record with reason ``malformed key``; it is never handed to a handler."""


class InvalidMsgIdError(RecordError):
    """A caller-supplied msg-id cannot be sent (empty, too long, or has a line break)."""


class KeylessRecordError(MissingKeyError):
    """A record has no key and keyless round-robin was not asked for.

    ``str(exc)`` names the Python switch (``allow_keyless=True``); an adapter with its own
    switch words the same fix in its terms with ``exc.message_for("--allow-keyless")``.
    """

    def __init__(self, switch: str = "allow_keyless=True") -> None:
        self.switch = switch
        super().__init__(self.message_for(switch))

    @staticmethod
    def message_for(switch: str) -> str:
        """The refusal, naming ``switch`` as the way to publish keyless records."""
        return (
            "record has no key; every record needs a key to keep per-key order "
            f"(set the key field), or publish with {switch} for round-robin"
        )


class BatchFailed(NatsOrderedError):
    """Raised by a batch handler that could not apply its whole batch: the first
    ``applied`` messages were applied (and must not be handed over again), the next one
    failed. The worker retries from the first unapplied message and, if it keeps failing,
    dead-letters (or blocks on) that message only. ``cause`` says why it failed."""

    def __init__(self, applied: int, cause: BaseException | str | None = None) -> None:
        if not isinstance(applied, int) or isinstance(applied, bool) or applied < 0:
            raise ValueError(f"BatchFailed(applied=...) must be an int >= 0, got {applied!r}")
        self.applied = applied
        self.cause = cause
        super().__init__(f"batch failed after {applied} applied message(s): {cause}")


class OrderConflict(NatsOrderedError):
    """Raised (by a sink, through the handler) for a message that can be neither applied nor
    skipped: applying it would break its partition's order and skipping it would lose it
    (e.g. the sink already applied another message under its sequence, because the
    servers' stored state went back). The worker neither retries nor dead-letters it: it
    stops the partition with a blocked marker saying why, until an operator resets it."""


def denial_in(exc: BaseException | None) -> PermissionDenied | None:
    """The :class:`PermissionDenied` behind ``exc``: ``exc`` itself, or found along its
    causes and contexts (and inside exception groups), so an error that wraps a denial
    (a :class:`~.publish.summary.PublishError`, an operator's failure) can still be
    reported as the missing permission. None if there is none."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc] if exc is not None else []
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, PermissionDenied):
            return e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        found = getattr(e, "denied", None)
        if isinstance(found, PermissionDenied):
            todo.append(found)
    return None


def exc_text(exc: BaseException) -> str:
    """An exception for a log line: its type and message, never an empty string
    (``TimeoutError()`` and many nats-py errors have an empty ``str()``)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
