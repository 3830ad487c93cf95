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


def broken(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    return " ".join(result.stdout.split())  # rich wraps long lines


def test_publish_importing_order_breaks_the_layers(tree: Path) -> None:
    core = "airflow_nats_ordered.core"
    inject(tree, f"{core}.publish.publisher", f"from {core}.order import watermarks\n")
    out = broken(run_lint_imports(tree, "core-layers"))
    assert f"{core}.publish is not allowed to import {core}.order" in out
    assert f"{core}.publish.publisher -> {core}.order.watermarks" in out


def test_siblings_of_one_layer_are_independent(tree: Path) -> None:
    core = "airflow_nats_ordered.core"
    inject(tree, f"{core}.sink.fenced", f"from {core}.group import store\n")
    out = broken(run_lint_imports(tree, "core-layers"))
    assert f"{core}.sink is not allowed to import {core}.group" in out


def test_the_core_importing_airflow_breaks_its_contract(tree: Path) -> None:
    inject(tree, "airflow_nats_ordered.core.stream.partitioned", "import airflow\n")
    out = broken(run_lint_imports(tree, "core-no-airflow-spark"))
    assert "airflow_nats_ordered.core.stream.partitioned -> airflow" in out


def test_the_core_importing_the_cli_breaks_its_contract(tree: Path) -> None:
    inject(tree, "airflow_nats_ordered.core.worker.worker", "import airflow_nats_ordered.cli\n")
    out = broken(run_lint_imports(tree, "core-no-wings-above"))
    assert "airflow_nats_ordered.core.worker.worker -> airflow_nats_ordered.cli" in out


def test_a_cycle_is_named_with_its_modules(tree: Path) -> None:
    stream = "airflow_nats_ordered.core.stream"
    inject(tree, f"{stream}.partitioned", f"def later():\n    from {stream} import strays\n")
    inject(tree, f"{stream}.strays", f"from {stream}.partitioned import later\n")
    out = broken(run_lint_imports(tree, "no-cycles"))
    assert f"Cycle 1, 2 modules: {stream}.partitioned, {stream}.strays" in out
    assert f"{stream}.partitioned -> {stream}.strays (l.2: from {stream} import strays)" in out
    assert f"{stream}.strays -> {stream}.partitioned (l.1:" in out
    # import-linter's own contract sees it too, by child
    assert "No cycles are allowed in airflow_nats_ordered.core.stream" in broken(
        run_lint_imports(tree, "no-package-cycles")
    )


def test_a_cycle_through_a_package_init_is_named(tree: Path) -> None:
    # a package's __init__ and its own submodule: acyclic_siblings does not look there
    hooks = "airflow_nats_ordered.hooks"
    inject(tree, hooks, f"from {hooks}.arguments import x\n")
    inject(tree, f"{hooks}.arguments", f"from {hooks} import y\n")
    assert run_lint_imports(tree, "no-package-cycles").returncode == 0
    out = broken(run_lint_imports(tree, "no-cycles"))
    assert f"Cycle 1, 2 modules: {hooks}, {hooks}.arguments" in out


def test_a_cycle_between_packages_without_a_module_cycle(tree: Path) -> None:
    # hooks -> operators and operators -> hooks through other modules: no module imports
    # itself back, but the two packages do
    inject(tree, "airflow_nats_ordered.hooks.arguments", "import airflow_nats_ordered.operators\n")
    operators = sorted((tree / "airflow_nats_ordered" / "operators").glob("[!_]*.py"))
    module = "airflow_nats_ordered.operators." + operators[0].stem
    inject(tree, module, "import airflow_nats_ordered.hooks\n")
    assert run_lint_imports(tree, "no-cycles").returncode == 0
    out = broken(run_lint_imports(tree, "no-package-cycles"))
    assert "No cycles are allowed in airflow_nats_ordered." in out
