"""The package's shape: no import cycle between solo's modules, the concepts named by its folders."""

from __future__ import annotations

import ast
from pathlib import Path

SOLO = Path(__file__).resolve().parents[1] / "solo"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOLO.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def solo_imports(path: Path, known: set[str]) -> set[str]:
    """Every solo module `path` imports, at module level or inside functions (lazy imports count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SOLO.rglob("*.py")}
    known = set(files)
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in solo_imports(path, known) if m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_inside_solo():
    graph = import_graph()
    assert len(graph) > 40 and graph["solo.engine.engine"]  # the walk really saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_layout_names_the_concepts():
    folders = {p.name for p in SOLO.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    concepts = {
        "model",
        "checkpoint",
        "quantization",
        "kernels",
        "engine",
        "speculative",
        "preflight",
        "serving",
        "bench",
    }
    assert concepts <= folders, f"missing: {concepts - folders}"
