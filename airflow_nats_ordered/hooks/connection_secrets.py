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

The former names ``creds``, ``nkey_seed`` and ``tls_key`` are refused, unread, with the
rename to make (:func:`check_no_former_names`). Airflow shows a value under such a name in
clear, and when the UI saves a connection it puts the stored value back for the ``***`` it
sends only under a name it hides: had the value been registered with the masker the REST
API redacts with, ``GET`` would show ``***`` and Save would store ``"***"`` over the
secret. Unread, it is never registered, and the stored value stays until renamed.
Credentials inside a URL (Host or extra ``servers``) would be shown in clear too;
:func:`check_no_url_credentials` refuses them.

:func:`secret_values` lists every secret value a connection holds, for the masker, so a
log line that repeats one (or one line of a ``.creds`` file or PEM key) shows ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from airflow_nats_ordered.core.errors import ConfigError

#: secret extras, by the name the masker recognises -> the ConnectionOptions option
SECRET_EXTRAS: Mapping[str, str] = {
    "token": "token",
    "creds_secret": "creds_file",
    "nkey_seed_secret": "nkey_seed",
    "tls_private_key": "tls_key_file",
}
#: former names of secret extras (shown in clear by Airflow; refused) -> the name to use
RENAMED_SECRET_EXTRAS: Mapping[str, str] = {
    "creds": "creds_secret",
    "nkey_seed": "nkey_seed_secret",
    "tls_key": "tls_private_key",
}
# a line of a .creds file or PEM block that is key material (not a marker or prose line)
_KEY_LINE = re.compile(r"[A-Za-z0-9+/=_.-]{16,}")


def check_no_former_names(where: str, extra: Mapping[str, Any]) -> None:
    """Refuse a secret under a former name (:data:`RENAMED_SECRET_EXTRAS`, with or without
    the UI's ``extra__nats__`` prefix), saying which extra to rename to what. An empty
    value (a field an older form saved blank) holds nothing and is let through. The
    message names keys only, never a value."""
    problems = []
    for key, value in extra.items():
        prefix = "extra__nats__" if key.startswith("extra__nats__") else ""
        new = RENAMED_SECRET_EXTRAS.get(key.removeprefix(prefix))
        if new is None or value in (None, ""):
            continue
        if extra.get(new) not in (None, "") or extra.get(f"extra__nats__{new}") not in (None, ""):
            problems.append(f"remove extra '{key}' (the former name of '{new}', also set)")
        else:
            problems.append(f"rename extra '{key}' to '{prefix}{new}'")
    if problems:
        raise ConfigError(
            f"{where}: {'; '.join(problems)}. Secrets under the former names are no longer "
            "read: Airflow's REST API and UI show them in clear, and put a stored value back "
            "for the *** the UI sends on Save only under names they hide. Rename it in the UI "
            "(Edit, the key in Extra Fields JSON, Save), in the AIRFLOW_CONN_* variable or in "
            "the secrets backend; the stored value is kept"
        )


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
    """Every secret value of a connection (Password and the secret extras; not a former
    name's, refused unread), and each key-material line of multi-line ones (a ``.creds``
    file's JWT and seed, a PEM key's lines), for the secrets masker."""
    values: list[str] = []
    for key, value in extra.items():
        name = key.removeprefix("extra__nats__")
        if name in SECRET_EXTRAS and isinstance(value, str):
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
