"""docs/design.md section 8 is the map of the code: every package under llamapipe/ has a heading there and
every module a row with its job, and nothing is named there that no longer exists."""
import os
import re

from tests.harness import ROOT

DESIGN = os.path.join(ROOT, "docs", "design.md")
PACKAGE = os.path.join(ROOT, "llamapipe")
_HEADING = re.compile(r"^### `(llamapipe/(?:[\w/]*/)?)`")
_ROW = re.compile(r"^\| `([\w.]+\.py)` \|")


def mapped(text: str) -> tuple[set, set]:
    """(package folders, module paths) that section 8 names, relative to the repository root."""
    section = text.split("\n## 8. ", 1)[1]
    packages, modules, current = set(), set(), None
    for line in section.splitlines():
        heading = _HEADING.match(line)
        if heading:
            current = heading.group(1)
            packages.add(current)
            continue
        row = _ROW.match(line)
        if row:
            assert current, f"docs/design.md section 8: row {row.group(1)} comes before any package heading"
            modules.add(current + row.group(1))
    return packages, modules


def on_disk() -> tuple[set, set]:
    """(package folders, module files other than __init__.py) under llamapipe/, relative to the root."""
    packages, modules = set(), set()
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        rel = os.path.relpath(folder, ROOT).replace(os.sep, "/") + "/"
        if "__init__.py" in files:
            packages.add(rel)
        modules |= {rel + f for f in files if f.endswith(".py") and f != "__init__.py"}
    return packages, modules


def test_parser_reads_headings_and_rows():
    text = ("# t\n## 8. Modules\n### `llamapipe/` — top\n| module | job |\n|---|---|\n| `cli.py` | x |\n"
            "### `llamapipe/core/pipeline_parallel/` — p\n| `executor.py` | runs plans |\n")
    assert mapped(text) == ({"llamapipe/", "llamapipe/core/pipeline_parallel/"},
                            {"llamapipe/cli.py", "llamapipe/core/pipeline_parallel/executor.py"})


def test_every_module_is_on_the_design_map():
    with open(DESIGN, encoding="utf-8") as f:
        packages, modules = mapped(f.read())
    real_packages, real_modules = on_disk()
    assert len(real_modules) > 80 and "llamapipe/core/pipeline_parallel/executor.py" in real_modules
    missing = sorted(real_modules - modules)
    assert not missing, ("docs/design.md section 8 does not name these modules; add a row "
                         f"'| `name.py` | <its job, from its docstring> |' under its package heading: {missing}")
    assert not sorted(real_packages - packages), \
        f"docs/design.md section 8 has no heading for the packages {sorted(real_packages - packages)}"
    stale = sorted((modules - real_modules) | (packages - real_packages))
    assert not stale, f"docs/design.md section 8 names modules or packages that do not exist: {stale}"
