"""Which fields of a ``nats`` connection hold secrets, and how they stay hidden in Airflow.

Airflow hides a connection's extra values **by key name**: the REST API
(``GET /api/v2/connections/{id}``, ``ConnectionResponse``), the UI that reads it, and the
task logs (``Connection.extra_dejson`` registers the values of such keys with the secrets
masker) hide the value of every extra whose name contains one of the masker's sensitive
words (``secret``, ``private_key``, ``token``, ``password``, ... plus ``[core]
sensitive_var_conn_names``). ``format: password`` on the connection form only hides the
form widget. So every secret extra of a ``nats`` connection is named with such a word:

==========================  ===========================================================
``token``                   token authentication
``creds_secret``            a decentralized-auth ``.creds`` file's content (JWT + NKEY seed)
``nkey_seed_secret``        an nkey seed ``SU...``
``tls_private_key``         a TLS client key (PEM content)
==========================  ===========================================================

The former names ``creds``, ``nkey_seed`` and ``tls_key`` are still read, so an existing
connection keeps working, but Airflow shows their values in clear (unless
``[core] sensitive_var_conn_names`` names them): :func:`clear_secret_warnings` says to
rename them. Credentials inside a URL (Host or extra ``servers``) would be shown in clear
too; :func:`check_no_url_credentials` refuses them.

:func:`secret_values` lists every secret value a connection holds, for the masker, so a
log line that repeats one (or one line of a ``.creds`` file or PEM key) shows ``***``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from airflow_nats_ordered.core.errors import ConfigError

log = logging.getLogger(__name__)

#: secret extras, by the name the masker recognises -> the ConnectionOptions option
SECRET_EXTRAS: Mapping[str, str] = {
    "token": "token",
    "creds_secret": "creds_file",
    "nkey_seed_secret": "nkey_seed",
    "tls_private_key": "tls_key_file",
}
#: former names of secret extras (shown in clear by Airflow) -> the name to use instead
RENAMED_SECRET_EXTRAS: Mapping[str, str] = {
    "creds": "creds_secret",
    "nkey_seed": "nkey_seed_secret",
    "tls_key": "tls_private_key",
}
# a line of a .creds file or PEM block that is key material (not a marker or prose line)
_KEY_LINE = re.compile(r"[A-Za-z0-9+/=_.-]{16,}")


def hidden_by_airflow(key: str) -> bool:
    """Whether Airflow's secrets masker hides the value of extra ``key`` (by its name)."""
    try:
        from airflow.sdk._shared.secrets_masker import should_hide_value_for_key
    except ImportError:  # pragma: no cover - another Airflow layout: assume the worst
        return False
    return bool(should_hide_value_for_key(key))


def renamed_extras(extra: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``extra`` with former secret names moved to their new names, and new name -> the
    former name used (for messages, which name what the user wrote); a ConfigError if a
    secret is given under both (which one is meant is unclear)."""
    out = dict(extra)
    used: dict[str, str] = {}
    for old, new in RENAMED_SECRET_EXTRAS.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(
                f"{where}: both extra '{old}' (its former name) and extra '{new}' are set; "
                f"keep only '{new}'"
            )
        out[new] = out.pop(old)
        used[new] = old
    return out, used


def clear_secret_warnings(conn_id: str, extra: Mapping[str, Any]) -> list[str]:
    """One sentence per extra of ``extra`` that holds a secret under a name Airflow's API,
    UI and logs show in clear (a former name), saying what to rename it to. Names only,
    never a value."""
    out = []
    for key in extra:
        name = key.removeprefix("extra__nats__")
        new = RENAMED_SECRET_EXTRAS.get(name)
        if new and extra[key] not in (None, "") and not hidden_by_airflow(key):
            out.append(
                f"Airflow connection {conn_id!r}: extra '{name}' holds a secret that "
                f"Airflow's REST API, UI and logs show in clear; rename it to '{new}', "
                "which they hide"
            )
    return out


def check_no_url_credentials(where: str, field: str, urls: Iterable[str]) -> None:
    """Refuse ``user:password@`` or ``token@`` in a URL of ``field``: Airflow shows Host and
    extra ``servers`` in clear. The message never repeats the credentials."""
    for url in urls:
        text = url.strip()
        netloc = urlsplit(text if "://" in text else f"nats://{text}").netloc
        if "@" in netloc:
            raise ConfigError(
                f"{where}: {field} has credentials in a URL (...@{netloc.rsplit('@', 1)[1]}), "
                "which Airflow shows in clear; put the user in Login and the password in "
                "Password, or a token in extra 'token', and give the URL without them"
            )


def secret_values(password: str | None, extra: Mapping[str, Any]) -> list[str]:
    """Every secret value of a connection (Password and the secret extras, under current
    or former names), and each key-material line of multi-line ones (a ``.creds`` file's
    JWT and seed, a PEM key's lines), for the secrets masker."""
    values: list[str] = []
    for key, value in extra.items():
        name = key.removeprefix("extra__nats__")
        if (name in SECRET_EXTRAS or name in RENAMED_SECRET_EXTRAS) and isinstance(value, str):
            values.append(value)
    if password:
        values.append(password)
    out = []
    for value in values:
        if not value.strip():
            continue
        out.append(value)
        if "\n" in value.strip():
            out.extend(
                line.strip() for line in value.splitlines() if _KEY_LINE.fullmatch(line.strip())
            )
    return out


def mask_secrets(values: Iterable[str]) -> None:
    """Register ``values`` with Airflow's secrets masker (also the task supervisor's)."""
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # pragma: no cover
        return
    for value in values:
        mask_secret(value)


async def amask_secrets(values: Iterable[str]) -> None:
    """:func:`mask_secrets` from a coroutine (a trigger): never blocks the event loop."""
    try:
        from airflow.sdk.log import amask_secret
    except ImportError:  # pragma: no cover
        return
    for value in values:
        await amask_secret(value)
