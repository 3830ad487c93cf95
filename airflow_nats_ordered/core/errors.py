"""Named errors. Every message says what was wrong and how to fix it."""

from __future__ import annotations


class NatsOrderedError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(NatsOrderedError, ValueError):
    """A setting, flag, connection extra or record is malformed."""


class ConnectError(NatsOrderedError):
    """The NATS servers could not be reached, or refused the connection."""


class AuthError(ConnectError):
    """The server rejected the credentials (user/password, token, creds, nkey) or TLS."""


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


def exc_text(exc: BaseException) -> str:
    """An exception for a log line: its type and message, never an empty string
    (``TimeoutError()`` and many nats-py errors have an empty ``str()``)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
