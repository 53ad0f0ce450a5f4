"""No dead code (issue 28 item 5): every top-level function and class under llamapipe/ is referenced somewhere
else: by other code of the package, the tests, the benchmarks, the scripts and examples, pretrain_llama.py
or pyproject.toml's entry points.

A reference is a name in the code (a call, an attribute, an import, a decorator), a string that is exactly the
name (`getattr`, registries) or a `module:name` entry point; mentions in docstrings, comments and docs/ do not
count, nor do uses inside the definition itself (recursion). Tests count as references, so a new module whose
only user so far is its own test passes. Deliberate public API that nothing in the repository calls goes into
ALLOWED with the reason it stays."""
import ast
import functools
import os
import re

from tests.harness import ROOT

SOURCES = ("llamapipe", "tests", "benchmarks", "scripts", "examples", "pretrain_llama.py")
THIS_FILE = os.path.relpath(__file__, ROOT)

# name -> why it stays although nothing in the repository references it
ALLOWED: dict[str, str] = {}

_ENTRY_POINT = re.compile(r"^[\w.]+:(\w+)$")


def _python_files() -> list[str]:
    paths = []
    for top in SOURCES:
        full = os.path.join(ROOT, top)
        if os.path.isfile(full):
            paths.append(top)
        for folder, _, names in os.walk(full):
            paths += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".py")]
    return sorted(p for p in paths if p != THIS_FILE)


def _referenced_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name.split(".")[-1]]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value.isidentifier():
            return [node.value]
        entry = _ENTRY_POINT.match(node.value)
        return [entry.group(1)] if entry else []
    return []


@functools.lru_cache(maxsize=1)
def _scan() -> tuple[list[tuple[str, str, int, int]], dict[str, list[tuple[str, int]]]]:
    """(top-level definitions of llamapipe/ as (file, name, first line, last line), name -> [(file, line)])."""
    definitions, references = [], {}
    for path in _python_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        if path.startswith("llamapipe" + os.sep):
            definitions += [(path, node.name, node.lineno, node.end_lineno) for node in tree.body
                            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in ast.walk(tree):
            for name in _referenced_names(node):
                references.setdefault(name, []).append((path, getattr(node, "lineno", 0)))
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        for line in f:
            for value in re.findall(r'"([\w.]+:\w+)"', line):
                references.setdefault(_ENTRY_POINT.match(value).group(1), []).append(("pyproject.toml", 0))
    return definitions, references


def _unreferenced() -> list[tuple[str, str, int]]:
    definitions, references = _scan()
    dead = []
    for path, name, first, last in definitions:
        outside = [r for r in references.get(name, []) if not (r[0] == path and first <= r[1] <= last)]
        if not outside:
            dead.append((path, name, first))
    return dead


def test_every_top_level_function_and_class_is_referenced():
    dead = [f"{path}:{line} {name}" for path, name, line in _unreferenced() if name not in ALLOWED]
    assert not dead, ("defined under llamapipe/ but referenced nowhere (remove them, or add them to ALLOWED in "
                      f"{THIS_FILE} with the reason they stay): {dead}")


def test_allowed_names_are_still_defined_and_still_unreferenced():
    """An ALLOWED entry that something now calls, or that is gone, is stale."""
    unreferenced = {name for _, name, _ in _unreferenced()}
    assert all(reason.strip() for reason in ALLOWED.values())
    stale = sorted(set(ALLOWED) - unreferenced)
    assert not stale, f"remove these from ALLOWED in {THIS_FILE}: referenced now, or no longer defined: {stale}"


def test_the_scan_finds_what_it_should(tmp_path):
    """The scan itself: a reference inside the definition does not count, a string or an entry point does."""
    tree = ast.parse("def f():\n    return f()\nx = getattr(m, 'g')\ny = 'pkg.mod:h'\n")
    names = [n for node in ast.walk(tree) for n in _referenced_names(node)]
    assert {"g", "h"} <= set(names) and names.count("f") == 1
    definitions, references = _scan()
    assert ("llamapipe/training/step.py", "SynchronousStep") in {(p, n) for p, n, _, _ in definitions}
    assert any(path.startswith("tests") for path, _ in references["SynchronousStep"])
