"""Check the shape of onward's import graph (``make check`` and tests/unit/test_import_graph.py run it).

Every import in ``src/onward`` counts: at module level, under ``if TYPE_CHECKING:``, inside functions (a
lazy import still ties two modules together), and a string that is exactly the dotted name of an onward
module (``"onward.deploy_cli"`` in the CLI's table of lazily loaded commands, for ``importlib``), unless
it is only compared with (``supervise`` recognises the words of ``python -m onward.cli`` so). The rules, each a property of the graph rather than a
list of modules, so that new modules are checked without editing this file:

1. No cycle: the graph is a DAG, so each module can be read knowing only what it imports.
2. The runner knows no backend: ``onward.runner`` reaches neither ``onward.store.sqlite`` nor
   ``onward.store.postgres``, directly or through anything it imports (it talks to the ``Store`` contract).
3. The store is the bottom layer: whatever a module under ``onward/store/`` imports, directly or not, is
   under ``onward/store/`` too or is one of the FOUNDATION modules below. These are the smallest set the
   store needs: error types, process identity (the owner of a claim), one-line logging, hiding
   passwords in messages (``redact``), and creating private folders (``folders``).
4. One door to the store: no module above ``onward/store/`` imports a backend module itself; they go
   through ``onward.store`` (``open_store``, ``list_jobs``, ``exists``, ``upgrade``), which picks the
   backend by URL.

Usage: ``python tools/check_imports.py [SRC]`` (SRC defaults to ``src`` next to this folder). Prints one
line per violation and exits 1, or exits 0 silently.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "onward"
STORE = "onward.store"
BACKENDS = ("onward.store.sqlite", "onward.store.postgres")
RUNNER = "onward.runner"
FOUNDATION = frozenset({"onward.errors", "onward.proc", "onward.log", "onward.redact", "onward.folders"})


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> Iterator[str]:
    """The onward modules that the file ``path`` (module ``name``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    compared = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for part in (node.left, *node.comparators) for c in ast.walk(part)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known(alias.name, modules)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in modules and id(node) not in compared:
            yield node.value  # imported by name at run time (importlib.import_module)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # ``from . import steps`` imports a module; ``from .steps import step`` a name of one.
                submodule = f"{target}.{alias.name}"
                yield from _known(submodule if submodule in modules else target, modules)


def _known(name: str, modules: set[str]) -> Iterator[str]:
    """``name`` itself if it is an onward module, else the closest onward module containing it."""
    while name:
        if name in modules:
            yield name
            return
        name = name.rpartition(".")[0]


def build_graph(src: Path) -> dict[str, set[str]]:
    files = {module_name(p, src): p for p in sorted((src / PACKAGE).rglob("*.py"))}
    # Modules written in C (``_clonespawn.c``) are leaves: they import no onward module.
    modules = set(files) | {module_name(p, src) for p in (src / PACKAGE).rglob("*.c")}
    return {name: set(imports_of(path, name, modules)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def in_store(name: str) -> bool:
    return name == STORE or name.startswith(STORE + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    cycle = find_cycle(graph)
    if cycle:
        found.append("import cycle: " + " -> ".join(cycle))
    if RUNNER in graph:
        for backend in sorted(reachable(graph, RUNNER) & set(BACKENDS)):
            found.append(f"{RUNNER} imports the backend {backend} (it must only know the Store contract)")
    for module in sorted(m for m in graph if not in_store(m)):
        for backend in sorted(graph[module] & set(BACKENDS)):
            found.append(f"{module} imports the backend {backend} (use onward.store's open_store/exists/upgrade)")
    for module in sorted(m for m in graph if in_store(m)):
        for above in sorted(m for m in reachable(graph, module) if not in_store(m) and m not in FOUNDATION):
            found.append(f"{module} imports {above}, which is above the store layer")
    return found


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "src"
    problems = violations(build_graph(src))
    for line in problems:
        print(f"check_imports: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
