"""Import layering of the package, read from the source with `ast` (nothing is imported).

The library (`llamapipe.core`) knows nothing of the application, the model or the data; the model knows
nothing of training, tools or data; the data nothing of training, tools or the model (docs/design.md
section 1). And no two parts import each other, directly or around a loop: the parts are core's
subpackages, each top-level core module, model, data, training, tools, and each top-level module.
Every import counts, also one inside a function or under `if TYPE_CHECKING:`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import llamapipe

ROOT = Path(llamapipe.__file__).parent
FORBIDDEN = {  # part -> parts it must not import
    "core": ("training", "tools", "model", "data"),
    "model": ("training", "tools", "data"),
    "data": ("training", "tools", "model"),
}


def _module_name(path: Path) -> str:
    parts = ("llamapipe",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute llamapipe module or package imported, line) for every import statement in the file."""
    name, found = _module_name(path), []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return [(target, line) for target, line in found if target.split(".")[0] == "llamapipe"]


def _part(module: str) -> str:
    """The layering unit of a module: core's subpackage ("core.pipeline_parallel"), a top-level core module
    ("core.config"), a top-level package ("model"), or a top-level module ("cli")."""
    parts = module.split(".")[1:]
    if not parts:
        return "llamapipe"
    if parts[0] == "core" and len(parts) > 1:
        return f"core.{parts[1]}"
    return parts[0]


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> where ("llamapipe/core/x.py:12 imports llamapipe.model.y")."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = _part(_module_name(path))
        for target, line in _imports(path):
            dest = _part(target)
            if dest != source:
                where = f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
                edges.setdefault((source, dest), []).append(where)
    return edges


def _top(part: str) -> str:
    return part.split(".")[0]


def test_the_reader_resolves_relative_and_nested_imports():
    """The checks below are only as good as the import reader: absolute, relative and function-level."""
    path = ROOT / "core" / "pipeline_parallel" / "executor.py"
    found = {target for target, _ in _imports(path)}
    assert "llamapipe.core.pipeline_parallel.schedule_ir.Plan" in found
    assert _part("llamapipe.core.pipeline_parallel.schedule_ir") == "core.pipeline_parallel"
    assert _part("llamapipe.core.config") == "core.config" and _part("llamapipe.training.loop") == "training"
    loop = {target for target, _ in _imports(ROOT / "training" / "loop.py")}
    assert any(t.startswith("llamapipe.core.optimizer") for t in loop), "imports inside functions must count"
    assert len(_edges()) > 20


def test_lower_layers_do_not_import_higher_ones():
    bad = [where for (source, dest), wheres in _edges().items() for where in wheres
           if _top(dest) in FORBIDDEN.get(_top(source), ())]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def _cycles(pairs) -> list[list[str]]:
    """For each part on a cycle, one cycle through it (part, ..., part), from (importer, imported) pairs."""
    graph: dict[str, set[str]] = {}
    for source, dest in pairs:
        graph.setdefault(source, set()).add(dest)
    cycles = []
    for start in sorted(graph):
        stack, seen, found = [(start, [start])], set(), None
        while stack and found is None:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found = path + [start]
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        if found:
            cycles.append(found)
    return cycles


def test_cycle_finder_on_a_toy_graph():
    assert _cycles([("a", "b"), ("b", "c"), ("c", "d")]) == []
    assert _cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                          ["c", "a", "b", "c"]]


def test_no_import_cycle_between_parts():
    edges = _edges()
    cycles = _cycles(edges)
    lines = [" -> ".join(cycle) + ": " + "; ".join(edges[(a, b)][0] for a, b in zip(cycle, cycle[1:]))
             for cycle in cycles]
    assert not cycles, "import cycles between parts:\n" + "\n".join(lines)
