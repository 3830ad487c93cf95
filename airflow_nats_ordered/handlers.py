"""Loading handlers named as ``package.module:attribute`` (CLI, Airflow operators).

The attribute may be a function or coroutine function taking one :class:`Message` (or a
list of them with ``--batch-handler``), or a class, which is instantiated without
arguments. An object may also define ``on_assign(partition, fencing_token)`` (called
when this member is granted a partition, before any of its messages, which is where a
fenced sink raises its fence), ``on_revoke(partition)`` and ``close()``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from .core.errors import ConfigError


@dataclass
class LoadedHandler:
    handler: Any
    on_assign: Any = None
    on_revoke: Any = None
    close: Any = None


def load_handler(path: str) -> LoadedHandler:
    """Import ``package.module:attribute``; errors say what is wrong with the path."""
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
            f"cannot import handler module {module_name!r}: {exc}; is it installed or on "
            "PYTHONPATH?"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        obj = obj()
    if not callable(obj):
        raise ConfigError(f"handler {path!r} is not callable")
    return LoadedHandler(
        obj,
        getattr(obj, "on_assign", None),
        getattr(obj, "on_revoke", None),
        getattr(obj, "close", None),
    )
