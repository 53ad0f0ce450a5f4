"""The library stays pure (docs/design.md section 1): nothing under llamapipe/core/ imports argparse, names a
command-line flag or reads or writes a file. Read from the source with `ast`, nothing is imported.

The rules, per file of llamapipe/core/:
- no `import argparse` (nor `from argparse import ...`);
- no string literal in code that looks like a flag (`--` then a lower-case letter, e.g. "--num-layers", also as
  a piece of an f-string): core's errors name config fields ("num_layers 8 ...", `core.config.ConfigError`) and
  training/ words them as flags (training/flag_names.py). Docstrings and comments may name flags: they say which
  feature uses the code, and the user never reads them as a message;
- no file I/O: no call of `open` (builtin, `io.open`, `os.open` or a path's `.open`), of a path's
  `read_text`/`read_bytes`/`write_text`/`write_bytes`, of `json.load`/`json.dump`, `torch.load`/`torch.save`,
  `pickle.load`/`pickle.dump`, nor a figure's `savefig`. Parsing or writing text in memory (`json.dumps`,
  `csv.reader` over a string) is the library's; reading the file it came from is the application's.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import llamapipe

CORE = Path(llamapipe.__file__).parent / "core"
FLAG = re.compile(r"--[a-z][a-z0-9-]+")
FILE_METHODS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "savefig"}
FILE_FUNCTIONS = {("json", "load"), ("json", "dump"), ("torch", "load"), ("torch", "save"), ("pickle", "load"),
                  ("pickle", "dump"), ("io", "open"), ("os", "open")}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _file_call(node: ast.Call) -> str | None:
    """The name of a file-I/O call, or None."""
    func = node.func
    if isinstance(func, ast.Name) and func.id == "open":
        return "open"
    if isinstance(func, ast.Attribute):
        if isinstance(func.value, ast.Name) and (func.value.id, func.attr) in FILE_FUNCTIONS:
            return f"{func.value.id}.{func.attr}"
        if func.attr in FILE_METHODS:
            return f".{func.attr}"
    return None


def impurities(source: str, where: str) -> list[str]:
    """Every breach of the rules above in `source` (the text of the file `where`), one line each."""
    tree, found = ast.parse(source), []
    docstrings = _docstrings(tree)
    for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            found.append(f"{line}: imports argparse")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            found.append(f"{line}: imports from argparse")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and FLAG.search(node.value)):
            found.append(f"{line}: names the flag {FLAG.search(node.value)[0]} in {node.value[:60]!r}")
        elif isinstance(node, ast.Call) and _file_call(node):
            found.append(f"{line}: file I/O ({_file_call(node)})")
    return found


def test_the_checker_finds_each_kind_and_allows_docstrings_and_comments():
    source = '''"""Module docstring may say --pipeline-schedule."""
import argparse
from argparse import Namespace
import json


def f(path, fig, n):
    """So may a function's: --num-layers."""
    # and a comment: --seq-length
    json.dumps({"a": 1})
    text = "a -- b and --- and x--y"
    with open(path) as fh:
        fh.read()
    Path(path).read_text()
    json.load(fh)
    fig.savefig(path)
    raise ValueError(f"--num-layers {n} is too few")
'''
    found = impurities(source, "toy.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports argparse", "imports from argparse", "file I/O (open)", "file I/O (.read_text)",
        "file I/O (json.load)", "file I/O (.savefig)", "names the flag --num-layers in '--num-layers '"], found


def test_core_has_no_argparse_no_flag_names_and_no_file_io():
    found = []
    for path in sorted(CORE.rglob("*.py")):
        found += impurities(path.read_text(), str(path.relative_to(CORE.parent.parent)))
    assert len(list(CORE.rglob("*.py"))) > 40, "the checker must see the whole library"
    assert not found, "llamapipe/core/ is not pure (docs/design.md section 1):\n" + "\n".join(found)
