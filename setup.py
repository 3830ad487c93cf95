"""Builds the compiled fast path (issue 33): every ``.pyx`` module of the package, with Cython,
as an *optional* extension. Everything else about the package is in pyproject.toml.

Each compiled module has a pure-Python twin with the same functions, which imports it
through :func:`airflow_nats_ordered.core.stream.compiled.load` (skipped when
``NATS_ORDERED_NO_EXTENSIONS`` is set). A build that cannot run here (no C compiler, no
Python headers, Cython not installed, a compile error) prints a warning and installs the
package without it: the pure-Python path is then used, as aiokafka does for its record
parser. ``NATS_ORDERED_NO_EXTENSIONS=1`` at install skips the build altogether.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SKIP = os.environ.get("NATS_ORDERED_NO_EXTENSIONS", "") not in ("", "0")


def _warn(what: str) -> None:
    print(
        f"WARNING: airflow-nats-ordered: {what}; the pure-Python path is used "
        "(correct, slower: docs/benchmarks.md)",
        file=sys.stderr,
    )


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: an extension that does not build is left out."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils' PlatformError and kin)
            _warn(f"the compiled fast path was not built ({exc})")

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:  # a compiler error, missing Python.h
            _warn(f"{ext.name} was not built ({exc})")


def _extensions() -> list:
    if SKIP:
        _warn("NATS_ORDERED_NO_EXTENSIONS is set")
        return []
    sources = sorted(
        p.relative_to(HERE).as_posix() for p in (HERE / "airflow_nats_ordered").rglob("*.pyx")
    )
    if not sources:
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed (it is a build requirement in pyproject.toml)")
        return []
    from setuptools import Extension

    exts = [
        Extension(src[: -len(".pyx")].replace("/", "."), [src], extra_compile_args=["-O2"])
        for src in sources
    ]
    try:
        return cythonize(
            exts,
            compiler_directives={
                "language_level": "3",
                "boundscheck": False,
                "wraparound": False,
                "cdivision": True,
            },
            quiet=True,
        )
    except Exception as exc:  # a .pyx Cython cannot translate
        _warn(f"Cython failed ({exc})")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
