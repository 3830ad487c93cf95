"""The compiled fast path (issue 33, goal 4) is built where it can be, and can be turned off.

Every ``.pyx`` of the package is a Cython twin of a pure-Python module (setup.py builds them
at install, optionally). Where a C compiler and the Python headers are present, each must
have been built (a silent fallback would make every figure in docs/benchmarks.md wrong);
``NATS_ORDERED_NO_EXTENSIONS=1`` must make :func:`compiled.load` give None. Each twin's own
tests run the same golden vectors through both implementations.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from airflow_nats_ordered.core.stream import compiled

PACKAGE = Path(__file__).resolve().parents[1] / "airflow_nats_ordered"
TWINS = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in PACKAGE.rglob("*.pyx")
)


def _can_build() -> bool:
    include = sysconfig.get_paths()["include"]
    return shutil.which(os.environ.get("CC", "cc")) is not None and os.path.exists(
        os.path.join(include, "Python.h")
    )


def test_the_package_has_compiled_twins_and_names_them_all():
    assert TWINS, "no .pyx module found: the compiled fast path is gone"
    assert sorted(compiled.TWINS) == TWINS


@pytest.mark.parametrize("name", TWINS)
def test_each_twin_is_built_where_a_compiler_is(name):
    if compiled.disabled():
        pytest.skip("NATS_ORDERED_NO_EXTENSIONS is set: this run tests the pure-Python path")
    if not _can_build():
        if os.environ.get("CI"):
            pytest.fail("CI has no C compiler or no Python headers: the fast path is not built")
        pytest.skip("no C compiler or Python headers here: the pure-Python path is used")
    assert compiled.load(name) is not None, (
        f"{name} was not built although a compiler is present: run `make venv` (or "
        "`python setup.py build_ext --inplace`) and read the install's warning"
    )


def test_no_extensions_turns_every_twin_off():
    code = (
        "from airflow_nats_ordered.core.stream import compiled; import sys; "
        f"print([compiled.load(n) is None for n in {TWINS!r}])"
    )
    for value, expected in (("1", True), ("", not _can_build())):
        # "" runs the installed build: where a compiler is, every twin is loaded
        env = dict(os.environ, NATS_ORDERED_NO_EXTENSIONS=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == repr([expected] * len(TWINS)), (value, out)
