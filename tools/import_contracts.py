"""Import-linter contract types of this project (registered in pyproject's [tool.importlinter]).

``acyclic``: no import cycle between any two modules of the given packages, at any depth.
import-linter's own ``acyclic_siblings`` looks for cycles between the children of a package
(each child with its descendants squashed); it does not see a cycle between a package's
``__init__`` and one of its own submodules, and it names at most five imports per package, by
child. This contract works on modules: it finds every strongly connected component of the
import graph (each module that can reach itself through imports) and names, for each, its
modules, one cycle through them and every import that binds them, with its line. Imports made
inside functions and under ``if TYPE_CHECKING:`` count like the others: a cycle that only a
deferred import lets Python load is still a cycle in the design.

The module sits outside the package so that the package does not ship its own lint rules;
``lint-imports`` imports it from the working directory (it puts that first on sys.path).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Set

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _within(module: str, packages: Set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def strongly_connected(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Every component of two or more modules that import each other, each one sorted
    (Tarjan's algorithm, iterative: the package is deeper than Python's recursion allows)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: Mapping[str, Set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as modules (first repeated
    last), found breadth-first inside the component."""
    start = component[0]
    inside = set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in a component but on no cycle")


class AcyclicContract(Contract):
    """No module of ``packages`` reaches itself through imports."""

    type_name = "acyclic"

    # the field's parsed value replaces it on the instance: a list of package names
    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        packages: set[str] = set(self.packages)  # type: ignore[call-overload]
        modules = {m for m in graph.modules if _within(m, packages)}
        missing = sorted(p for p in packages if p not in modules)
        if missing:
            raise ValueError(f"acyclic: no such package in the graph: {', '.join(missing)}")
        imports = {
            m: {i for i in graph.find_modules_directly_imported_by(m) if i in modules}
            for m in modules
        }
        cycles = []
        for component in strongly_connected(imports):
            members = set(component)
            lines = sorted(
                (
                    detail["importer"],
                    detail["line_number"],
                    detail["imported"],
                    detail["line_contents"],
                )
                for importer in component
                for imported in sorted(imports[importer] & members)
                for detail in graph.get_import_details(importer=importer, imported=imported)
            )
            cycles.append(
                {
                    "modules": component,
                    "cycle": shortest_cycle(imports, component),
                    "imports": lines,
                }
            )
        output.verbose_print(verbose, f"{len(modules)} modules, {len(cycles)} import cycles")
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        cycles = check.metadata["cycles"]
        output.print_error(f"{len(cycles)} import cycle(s):", bold=True)
        output.new_line()
        for number, cycle in enumerate(cycles, 1):
            output.print_error(
                f"Cycle {number}, {len(cycle['modules'])} modules: {', '.join(cycle['modules'])}",
                bold=True,
            )
            output.print(f"  for example {' -> '.join(cycle['cycle'])}")
            output.print("  the imports that bind them:")
            for importer, line, imported, contents in cycle["imports"]:
                output.print(f"  - {importer} -> {imported} (l.{line}: {contents.strip()})")
            output.new_line()
