"""The import contracts of `make lint` ([tool.importlinter] in pyproject.toml) can fail.

Each test lays out the package's own tree (every package and module, by name, empty) in a tmp
directory with the project's pyproject.toml and tools/, checks that lint-imports keeps every
contract there, then writes one forbidden import into it and checks that lint-imports fails
naming it. An empty tree keeps every contract, so each failure is the injected import's: the
contracts are the project's own, and the tree follows the package's layout as it changes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from locations import ROOT

PACKAGES = ("airflow_nats_ordered", "pyspark_nats_ordered")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def run_lint_imports(where: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    # lint-imports puts its working directory first on sys.path: it reads the tmp tree, and
    # imports tools.import_contracts from there
    only = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", *only],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def empty_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's layout with no imports: every contract kept."""
    tree = tmp_path_factory.mktemp("empty_tree")
    for package in PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            target = tree / source.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text('"""Empty."""\n')
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copytree(ROOT / "tools", tree / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    result = run_lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    return tree


@pytest.fixture
def tree(empty_tree: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "tree"
    shutil.copytree(empty_tree, copy)
    return copy


def inject(tree: Path, module: str, source: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = tree / module.replace(".", "/") / "__init__.py"
    assert path.exists(), f"{module} is not in the package's tree"
    path.write_text(source)


def modules_of(tree: Path, package: str, count: int = 1) -> list[str]:
    """The first modules of a package (by name, no __init__): the tests do not depend on
    which modules a wing has today."""
    files = sorted((tree / package.replace(".", "/")).glob("[!_]*.py"))
    assert len(files) >= count, f"{package} has fewer than {count} modules"
    return [f"{package}.{f.stem}" for f in files[:count]]


def broken(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    return " ".join(result.stdout.split())  # rich wraps long lines


CORE = "airflow_nats_ordered.core"


def test_publish_importing_order_breaks_the_layers(tree: Path) -> None:
    [publish] = modules_of(tree, f"{CORE}.publish")
    [order] = modules_of(tree, f"{CORE}.order")
    inject(tree, publish, f"import {order}\n")
    out = broken(run_lint_imports(tree, "core-layers"))
    assert f"{CORE}.publish is not allowed to import {CORE}.order" in out
    assert f"{publish} -> {order}" in out


def test_siblings_of_one_layer_are_independent(tree: Path) -> None:
    [sink] = modules_of(tree, f"{CORE}.sink")
    inject(tree, sink, f"from {CORE} import group\n")
    out = broken(run_lint_imports(tree, "core-layers"))
    assert f"{CORE}.sink is not allowed to import {CORE}.group" in out


def test_the_core_importing_airflow_breaks_its_contract(tree: Path) -> None:
    [stream] = modules_of(tree, f"{CORE}.stream")
    inject(tree, stream, "import airflow\n")
    out = broken(run_lint_imports(tree, "core-no-airflow-spark"))
    assert f"{stream} -> airflow" in out


def test_the_core_importing_the_cli_breaks_its_contract(tree: Path) -> None:
    [worker] = modules_of(tree, f"{CORE}.worker")
    inject(tree, worker, "import airflow_nats_ordered.cli\n")
    out = broken(run_lint_imports(tree, "core-no-wings-above"))
    assert f"{worker} -> airflow_nats_ordered.cli" in out


def test_a_cycle_is_named_with_its_modules(tree: Path) -> None:
    # one side deferred into a function, as cycles hide: still a cycle
    first, second = modules_of(tree, f"{CORE}.stream", 2)
    package, name = second.rsplit(".", 1)
    inject(tree, first, f"def later():\n    from {package} import {name}\n")
    inject(tree, second, f"from {first} import later\n")
    out = broken(run_lint_imports(tree, "no-cycles"))
    assert f"Cycle 1, 2 modules: {first}, {second}" in out
    assert f"{first} -> {second} (l.2: from {package} import {name})" in out
    assert f"{second} -> {first} (l.1:" in out
    # import-linter's own contract sees it too, by child
    assert f"No cycles are allowed in {CORE}.stream" in broken(
        run_lint_imports(tree, "no-package-cycles")
    )


def test_a_cycle_through_a_package_init_is_named(tree: Path) -> None:
    # a package's __init__ and its own submodule: acyclic_siblings does not look there
    hooks = "airflow_nats_ordered.hooks"
    [submodule] = modules_of(tree, hooks)
    inject(tree, hooks, f"import {submodule}\n")
    inject(tree, submodule, f"from {hooks} import y\n")
    assert run_lint_imports(tree, "no-package-cycles").returncode == 0
    out = broken(run_lint_imports(tree, "no-cycles"))
    assert f"Cycle 1, 2 modules: {hooks}, {submodule}" in out


def test_a_cycle_between_packages_without_a_module_cycle(tree: Path) -> None:
    # hooks -> operators and operators -> hooks through other modules: no module imports
    # itself back, but the two packages do
    [hook] = modules_of(tree, "airflow_nats_ordered.hooks")
    [operator] = modules_of(tree, "airflow_nats_ordered.operators")
    inject(tree, hook, "import airflow_nats_ordered.operators\n")
    inject(tree, operator, "import airflow_nats_ordered.hooks\n")
    assert run_lint_imports(tree, "no-cycles").returncode == 0
    out = broken(run_lint_imports(tree, "no-package-cycles"))
    assert "No cycles are allowed in airflow_nats_ordered." in out
