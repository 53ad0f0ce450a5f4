"""The README and docs/ stay true: the generated flag reference matches the parser, the README stays short,
every relative link (and its #anchor) points at something that exists, and the repository paths the pages
name exist."""
import glob
import os
import re

import pytest

from llamapipe.tools import flag_reference
from llamapipe.training.arguments import build_parser
from tests.harness import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str) -> set:
    text = _FENCE.sub("", _read(path))
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_flag_reference_is_up_to_date():
    with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == flag_reference.render(build_parser()), \
        "docs/flags.md is out of date: run `python -m llamapipe flag-reference` from the repository root"


def test_flag_reference_lists_every_flag_once_with_its_default():
    parser = build_parser()
    text = flag_reference.render(parser)
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 50
    for a in actions:
        row = "| " + ", ".join(f"`{s}`" for s in a.option_strings) + " |"
        assert text.count("\n" + row) == 1, row
    assert "| `--tensor-model-parallel-size` | `1` |" in text
    assert "| `--use-distributed-optimizer` | off |" in text
    assert text == flag_reference.render(build_parser())   # deterministic


def test_flag_reference_check_mode(tmp_path, capsys):
    out = tmp_path / "flags.md"
    assert flag_reference.main(["--out", str(out), "--check"]) == 1      # missing
    assert flag_reference.main(["--out", str(out)]) == 0
    assert flag_reference.main(["--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "stale\n")
    assert flag_reference.main(["--out", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_readme_is_at_most_300_lines():
    assert len(_read(os.path.join(ROOT, "README.md")).splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_point_at_existing_files_and_headings(page):
    text = _FENCE.sub("", _read(page))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target} (no file)")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading)")
    assert not broken, f"{os.path.relpath(page, ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_named_repository_paths_exist(page):
    """Paths such as `llamapipe/core/host_memory.py` or `scripts/quickstart.sh` in backticks; patterns
    (`*`, `{..}`, `<..>`, `…`) and what the examples write (`runs/`) are left out."""
    names = re.findall(r"`((?:llamapipe|scripts|benchmarks|tests|docs)/[^`\s]*)`", _read(page))
    missing = [n for n in names if not re.search(r"[*{}<>…]|NAME", n) and not _names_something(n)]
    assert not missing, f"{os.path.relpath(page, ROOT)} names missing paths: {missing}"


def _names_something(name: str) -> bool:
    """A path that exists; `file.py::test_x` (a test, as pytest names it) also needs `def test_x` in the file,
    and a following `::test_y` on the same row names another test of that file."""
    path, _, test = name.partition("::")
    if not os.path.exists(os.path.join(ROOT, path)):
        return False
    return not test or re.search(rf"^def {re.escape(test)}\(", _read(os.path.join(ROOT, path)), re.M) is not None


def test_reliability_page_names_only_tests_that_exist():
    """docs/reliability.md's table: every `::test_name` (also the short ones after a named file) is a test."""
    text = _read(os.path.join(ROOT, "docs", "reliability.md"))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "test_" in line]
    assert len(rows) >= 20
    for row in rows:
        files = re.findall(r"`((?:tests/)?[\w/]*test_\w+\.py)", row)
        assert files, row
        for test in re.findall(r"::(test_\w+)", row):
            sources = [_read(p) for f in files for p in _test_files(f)]
            assert any(re.search(rf"^def {test}\(", src, re.M) for src in sources), f"{test} is not in {files}"


def _test_files(name: str) -> list[str]:
    """`tests/e2e/test_x.py`, or a bare `test_x.py` found under tests/."""
    if "/" in name:
        return [os.path.join(ROOT, name)]
    return [os.path.join(d, name) for d, _, fs in os.walk(os.path.join(ROOT, "tests")) if name in fs]


def test_design_sections_cited_by_docstrings_exist():
    """Docstrings cite 'docs/design.md section N'; each cited section must exist with its meaning."""
    headings = re.findall(r"^## (\d+)\. (.+)$", _read(os.path.join(ROOT, "docs", "design.md")), re.MULTILINE)
    titles = dict(headings)
    cited = set()
    for path in glob.glob(os.path.join(ROOT, "llamapipe", "**", "*.py"), recursive=True):
        cited |= set(re.findall(r"docs/design\.md section (\d+)", _read(path)))
    assert cited and cited <= set(titles), f"cited {sorted(cited)}, present {sorted(titles)}"
    assert titles["2"].startswith("Process groups") and titles["3"].startswith("Pipeline runtime")
    assert titles["4"].startswith("Numerics")
