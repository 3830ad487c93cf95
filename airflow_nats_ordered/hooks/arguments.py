"""Misspelt keyword arguments of triggers and operators fail, naming the close match.

A trigger that took ``**kwargs`` into its base class would silently ignore
``subjects=...`` and read the whole stream; Airflow's own refusal of an operator's unknown
argument does not say what was meant. :func:`refuse_unknown_arguments` raises a
:class:`~airflow_nats_ordered.core.errors.ConfigError` (a ``ValueError``) that names each
unknown argument, the valid one it most resembles (``difflib``) and every valid one.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from airflow_nats_ordered.core.errors import ConfigError


def keyword_parameters(fn: Callable[..., Any]) -> list[str]:
    """The names ``fn`` accepts by keyword, in signature order (``self`` and ``**`` left out)."""
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.name != "self"
    ]


def unknown_arguments_message(owner: str, unknown: Iterable[str], valid: Iterable[str]) -> str:
    """``"<owner>: unknown argument(s) subjects= (did you mean subject=?); the valid
    arguments are ..."``."""
    valid = list(valid)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name}= (did you mean {close[0]}=?)" if close else f"{name}=")
    return (
        f"{owner}: unknown argument(s) {', '.join(hints)}; the valid arguments are "
        f"{', '.join(valid)}"
    )


def refuse_unknown_arguments(
    owner: str, unknown: Mapping[str, Any], fn: Callable[..., Any]
) -> None:
    """Raise ConfigError if ``unknown`` (the ``**`` catch-all of ``fn``) is not empty."""
    if unknown:
        raise ConfigError(unknown_arguments_message(owner, unknown, keyword_parameters(fn)))


def refuse_unknown_operator_arguments(op: object, kwargs: Mapping[str, Any]) -> None:
    """Call in an operator's ``__init__`` before ``super().__init__(**kwargs)``: raise
    ConfigError for a keyword no ``__init__`` of the operator's classes accepts (its own,
    BaseOperator's, a sensor's or SparkSubmitOperator's), naming the close match among all
    of them and listing the operator's own. Airflow's refusal (``TypeError: Invalid arguments
    were passed ...``) names the argument but not the one meant."""
    own: list[str] = []
    valid: list[str] = []
    for cls in type(op).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or cls is object:
            continue
        names = keyword_parameters(init)
        if not own:
            own = names
        valid += [n for n in names if n not in valid]
    # Airflow's own markers (e.g. ``_airflow_mapped_validation_only``) pass through
    unknown = [k for k in kwargs if k not in valid and not k.startswith("_airflow_")]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name}= (did you mean {close[0]}=?)" if close else f"{name}=")
    raise ConfigError(
        f"{type(op).__name__}: unknown argument(s) {', '.join(hints)}; its own arguments are "
        f"{', '.join(own)}, beside BaseOperator's (task_id, retries, ...)"
    )
