"""Offline checks of credential files and nkey seeds, before nats-py ever sees them.

:func:`_check_creds_file` makes sure a ``.creds`` file has the JWT and seed blocks
(nats-py loops forever on a creds file without the JWT marker, so
:func:`~.connect.connect` re-checks it before every
connect); :func:`_check_seed` validates an nkey seed without ever putting it in a
message. Used by :class:`~.options.ConnectionOptions`
validation and by ``connect()``.
"""

from __future__ import annotations

from airflow_nats_ordered.core.connection.fields import _FIELD_TO_ENV, _config_error


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
