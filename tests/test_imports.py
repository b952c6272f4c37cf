"""The package's import graph has no cycle, counting imports inside functions (a lazy import that
closes a cycle hides it, it does not remove it) and the packages an import runs first."""

import ast
import pathlib

import samcache

ROOT = pathlib.Path(samcache.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """Import statements anywhere in ``tree`` but under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _type_checking_only(child))


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package modules importing it runs: each target and its parent packages, less
    the importer's own packages (they run before it anyway)."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        targets = []
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [known(a.name) for a in node.names]
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets += [known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base) for a in node.names]
        for target in filter(None, targets):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                runs = ".".join(parts[:i])
                if runs in mods and runs != mod and not mod.startswith(runs + "."):
                    graph[mod].add(runs)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_walk_finds_a_cycle_where_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    mods = modules()
    graph = import_graph(mods)
    # The walk sees imports inside functions, and the packages an import runs first.
    assert "samcache.engine.calibration" in graph["samcache.engine.api"]
    assert "samcache.engine" in graph["samcache.bench.task_accuracy"]  # imported inside a function
    assert len(mods) > 100


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph(modules()))
    assert cycle is None, " -> ".join(cycle)
