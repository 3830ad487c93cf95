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
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .core.errors import ConfigError


@dataclass
class LoadedHandler:
    handler: Any
    on_assign: Any = None
    on_revoke: Any = None
    close: Any = None
    fencing_floor: Any = None
    applied_position: Any = None


_SCOPE = ("stream", "group")


def _instantiate(path: str, cls: type, scope: dict[str, str | None]) -> Any:
    """``cls()``, passing those of ``stream`` and ``group`` that its ``__init__`` names."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C class: no introspectable signature
        params = {}
    wanted = [name for name in _SCOPE if name in params]
    missing = [name for name in wanted if not scope[name]]
    if missing:
        raise ConfigError(
            f"handler class {path!r} takes {' and '.join(wanted)} (to open its sink for the "
            f"worker's stream and group) but no {' or '.join(missing)} was given: pass "
            + ", ".join(f"{name}=..." for name in missing)
            + " to load_handler"
        )
    return cls(**{name: scope[name] for name in wanted})


def load_handler(
    path: str, *, stream: str | None = None, group: str | None = None
) -> LoadedHandler:
    """Import ``package.module:attribute``; errors say what is wrong with the path.

    ``stream`` and ``group`` (the worker's) are passed to a handler class that takes them.
    """
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
