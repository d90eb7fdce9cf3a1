"""Print the import graph's cycles among rankwise's modules (``python tools/import_cycles.py``).

Every ``import``/``from ... import`` counts, at module level, inside a function and under
``if TYPE_CHECKING:`` (never executed, but a type named there is a dependency all the same: a
circle through annotations is a circle in the design) and under ``if __name__ == "__main__":``
(a script that imports the module that imports it is the same circle, run one way round; a
script entry point belongs in cli.py, ``python -m rankwise <command>``). ``from .pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. The implicit import of a parent package
(``import a.b`` runs ``a/__init__``) is not an edge: it is what makes packages, not layering.
Exit status 1 when there is a cycle. ``--edges`` also prints every edge.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "rankwise"


def modules(src: Path = SRC) -> dict[str, Path]:
    found = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST):
    """Import nodes, wherever they are (``if TYPE_CHECKING:``, ``if __name__ == ...``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [
                    f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names
                ]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv: list[str]) -> int:
    graph = edges(modules())
    if "--edges" in argv:
        for name in sorted(graph):
            print(f"{name} -> {', '.join(sorted(graph[name])) or '(nothing)'}")
    found = cycles(graph)
    print(
        f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges "
        f"(TYPE_CHECKING and __main__-guard imports included), {len(found)} cycle(s)"
    )
    for comp in found:
        print(f"cycle of {len(comp)}: {' '.join(comp)}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
