"""Which of the compiled fast path's modules (issue 33) this process uses.

The hot loops (frame and header parsing, a record's wire form) each live twice: a
pure-Python module, which is the reference, and a Cython twin (``_<name>.pyx`` beside it,
built at install by setup.py when a C compiler and the Python headers are there). The
pure-Python module asks :func:`load` for its twin at import and takes the twin's functions
when it was built; both are tested against the same golden vectors. Setting
``NATS_ORDERED_NO_EXTENSIONS=1`` (as aiokafka's ``NO_EXTENSIONS``) makes every module use
the pure-Python path, at install (nothing is compiled) or at run time (nothing compiled
is loaded). :func:`status` says which twins were loaded (``make bench`` prints it).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: the environment variable that turns the compiled fast path off
NO_EXTENSIONS = "NATS_ORDERED_NO_EXTENSIONS"

#: every compiled twin of the package (tests/test_compiled.py checks this against the .pyx
#: files; the Dockerfile's build fails if one of them was not built)
TWINS = (
    "airflow_nats_ordered.core.stream._frames",
    "airflow_nats_ordered.core.publish._records",
)

_loaded: dict[str, bool] = {}


def disabled() -> bool:
    """Whether ``NATS_ORDERED_NO_EXTENSIONS`` asks for the pure-Python path."""
    return os.environ.get(NO_EXTENSIONS, "") not in ("", "0")


def load(name: str) -> ModuleType | None:
    """The compiled twin ``name`` (a module path), or None: turned off by
    ``NATS_ORDERED_NO_EXTENSIONS``, or not built at install."""
    module = None
    if not disabled():
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = None
    _loaded[name] = module is not None
    return module


def status() -> dict[str, bool]:
    """Each twin asked for so far -> whether the compiled one is in use."""
    return dict(_loaded)
