"""Loading handlers named as ``package.module:attribute`` (CLI, Airflow operators).

The attribute may be a function or coroutine function taking one :class:`Message` (or a
list of them with ``--batch-handler``), or a class, which is instantiated once. The class is
given the worker's ``stream`` and ``group`` as keyword arguments if its ``__init__`` takes
parameters of those names (so it can open a fenced sink for its (stream, group)), and no
arguments otherwise. An object may also define ``on_assign(partition, fencing_token)``
(called when this member is granted a partition, before any of its messages, which is where
a fenced sink raises its fence), ``on_revoke(partition)``, ``close()``,
``fencing_floor(partition) -> int`` (the highest token its sink has seen for the partition:
the worker grants the partition only with a larger token) and
``applied_position(partition) -> (seq, msg_id) | None`` (the last message its sink applied:
the worker checks it is still in the stream before handling the partition, and stops the
partition if the servers' stored state went back). Each may be a coroutine function.

Where modules are found: ``nats-ordered worker`` and ``pool`` call
:func:`current_directory_first`, so a module in the directory they are started from is
found first, as with ``python -m`` and gunicorn. Every problem with a handler (a bad path,
a module that cannot be imported or raises while importing, a missing attribute, a class
that cannot be created) is a :class:`~..core.errors.ConfigError` saying what to fix.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_nats_ordered.core.errors import ConfigError, NatsOrderedError


@dataclass
class LoadedHandler:
    handler: Any
    on_assign: Any = None
    on_revoke: Any = None
    close: Any = None
    fencing_floor: Any = None
    applied_position: Any = None


_SCOPE = ("stream", "group")


def current_directory_first() -> None:
    """Put the current directory first on ``sys.path`` (unless it is already), as
    ``python -m`` and gunicorn do: ``--handler mymodule:apply`` finds ``./mymodule.py``
    whether the CLI was started as ``nats-ordered`` (whose ``sys.path`` starts with the
    script's directory) or as a pool member (``python -m``)."""
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in ("", cwd):
        sys.path.insert(0, cwd)


def _params(cls: type) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C class: no introspectable signature
        return {}


def _class_kwargs(path: str, cls: type, scope: dict[str, str | None]) -> dict[str, str | None]:
    """The keyword arguments ``cls`` is created with: those of ``stream`` and ``group``
    that its ``__init__`` names. Raises ConfigError if one is missing or the signature
    wants other arguments."""
    params = _params(cls)
    wanted = [name for name in _SCOPE if name in params]
    missing = [name for name in wanted if not scope[name]]
    if missing:
        raise ConfigError(
            f"handler class {path!r} takes {' and '.join(wanted)} (to open its sink for the "
            f"worker's stream and group) but no {' or '.join(missing)} was given: pass "
            + ", ".join(f"{name}=..." for name in missing)
            + " to load_handler"
        )
    kwargs = {name: scope[name] for name in wanted}
    if params:
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"handler class {path!r} cannot be created with "
                f"{', '.join(f'{k}=...' for k in kwargs) or 'no arguments'} ({exc}): a handler "
                "class takes no arguments, or only stream and group"
            ) from None
    return kwargs


def _instantiate(path: str, cls: type, scope: dict[str, str | None]) -> Any:
    """``cls()``, passing those of ``stream`` and ``group`` that its ``__init__`` names."""
    kwargs = _class_kwargs(path, cls, scope)
    try:
        return cls(**kwargs)
    except NatsOrderedError:  # already says what to fix
        raise
    except Exception as exc:
        raise ConfigError(
            f"handler class {path!r} could not be created: {type(exc).__name__}: {exc}"
        ) from exc


def _resolve(path: str) -> Any:
    """The object ``package.module:attribute`` names (imported, not instantiated)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"handler {path!r} must look like package.module:function (a module, a colon, "
            "then the function or class name)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import handler module {module_name!r}: {exc}; is it installed, on "
            "PYTHONPATH or in the current directory?"
        ) from exc
    except Exception as exc:  # the module's own code failed while importing
        raise ConfigError(
            f"cannot import handler module {module_name!r}: it raised "
            f"{type(exc).__name__}: {exc} while importing"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def check_handler(path: str, *, stream: str | None = None, group: str | None = None) -> None:
    """Check what :func:`load_handler` would load, without creating a handler class (which
    may open a sink): the path, the import, the attribute, and that it is callable or a
    class that can be created with the worker's ``stream`` and ``group``. Raises the same
    :class:`ConfigError` as :func:`load_handler` would."""
    obj = _resolve(path)
    if inspect.isclass(obj):
        _class_kwargs(path, obj, {"stream": stream, "group": group})
    elif not callable(obj):
        raise ConfigError(f"handler {path!r} is not callable")


def load_handler(
    path: str, *, stream: str | None = None, group: str | None = None
) -> LoadedHandler:
    """Import ``package.module:attribute``; errors say what is wrong with the path.

    ``stream`` and ``group`` (the worker's) are passed to a handler class that takes them.
    """
    obj = _resolve(path)
    if inspect.isclass(obj):
        obj = _instantiate(path, obj, {"stream": stream, "group": group})
    if not callable(obj):
        raise ConfigError(f"handler {path!r} is not callable")
    return LoadedHandler(
        obj,
        getattr(obj, "on_assign", None),
        getattr(obj, "on_revoke", None),
        getattr(obj, "close", None),
        getattr(obj, "fencing_floor", None),
        getattr(obj, "applied_position", None),
    )
