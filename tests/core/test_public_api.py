"""The core's public API: the names ``airflow_nats_ordered.core`` exports, loaded lazily.

Every name in ``__all__`` resolves to the object its module defines; the table in
``core/__init__.py`` names the module each is defined in (not one that imports it); the
``TYPE_CHECKING`` imports that type checkers read list the same names; and importing the
package loads none of its wings.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

import airflow_nats_ordered.core as core

INIT = Path(core.__file__)


def defined_at_top_level(module: str) -> set[str]:
    """The names a module binds itself (classes, functions, assignments), not its imports."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    names: set[str] = set()
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def type_checking_imports() -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in core/__init__.py."""
    found: dict[str, str] = {}
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.unparse(stmt)
                for alias in stmt.names:
                    assert alias.asname is None, ast.unparse(stmt)
                    found[alias.name] = stmt.module
    return found


def test_all_the_table_and_the_type_checking_imports_list_the_same_names() -> None:
    table = [name for names in core._EXPORTS.values() for name in names]
    assert len(table) == len(set(table)), "a name is in two modules of the table"
    assert len(core.__all__) == len(set(core.__all__))
    assert sorted(core.__all__) == sorted(table)
    assert type_checking_imports() == core._MODULE_OF


@pytest.mark.parametrize("name", sorted(core.__all__))
def test_each_name_resolves_to_what_its_module_defines(name: str) -> None:
    module = core._MODULE_OF[name]
    assert name in defined_at_top_level(module), f"{name} is not defined in {module}"
    value = getattr(core, name)
    assert value is getattr(importlib.import_module(module), name)
    # a class or function says where it was defined; a type alias (Handler, BatchItem) does not
    if inspect.isfunction(value) or (
        isinstance(value, type) and not isinstance(value, types.GenericAlias)
    ):
        assert value.__module__ == module


def test_each_module_of_the_table_is_in_the_core() -> None:
    for module in core._EXPORTS:
        assert module.startswith("airflow_nats_ordered.core."), module
        assert importlib.util.find_spec(module) is not None, module


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'OrderedPublisherr'"):
        core.OrderedPublisherr  # noqa: B018
    with pytest.raises(ImportError):
        from airflow_nats_ordered.core import OrderedPublisherr  # noqa: F401


def test_dir_lists_every_public_name() -> None:
    assert set(core.__all__) <= set(dir(core))


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_the_core_imports_none_of_its_wings() -> None:
    out = run_python(
        "import sys, airflow_nats_ordered.core\n"
        "print(sorted(m for m in sys.modules if m.startswith('airflow_nats_ordered')))\n"
        "print('nats' in sys.modules)\n"
    )
    assert out.split("\n")[:2] == ["['airflow_nats_ordered', 'airflow_nats_ordered.core']", "False"]


def test_star_import_gives_every_public_name() -> None:
    out = run_python(
        "ns = {}\n"
        "exec('from airflow_nats_ordered.core import *', ns)\n"
        "import airflow_nats_ordered.core as core\n"
        "print(sorted(set(core.__all__) - set(ns)))\n"
    )
    assert out.strip() == "[]"
