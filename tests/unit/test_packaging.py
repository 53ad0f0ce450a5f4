"""The wheel installs only the `llamapipe` package and its `llamapipe` command (issue 24): no top-level
`core`, `model` or `data` that would shadow, or be shadowed by, a user's own folders of those names."""
import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.harness import ROOT

# Build outputs and caches in the checkout are not sources; leaving them out keeps the build in tmp_path.
_NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "runs", "__pycache__", ".*cache*")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """Build the wheel from a copy of the checkout (so no build/ or egg-info lands in the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = (tmp / "dist").glob("llamapipe-*.whl")
    return str(path)


def test_wheel_holds_only_the_llamapipe_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"llamapipe"}, f"unexpected top-level entries: {sorted(tops - dist_info)}"
    assert len(dist_info) == 1
    for module in ("cli.py", "train.py", "core/pipeline_parallel/executor.py", "training/arguments/parser.py",
                   "model/llama/model.py", "data/gpt_dataset.py", "tools/flag_reference.py"):
        assert f"llamapipe/{module}" in names
    assert not any(n.startswith(("llamapipe/tests", "llamapipe/benchmarks")) for n in names)


def test_wheel_declares_the_llamapipe_command(wheel):
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"llamapipe": "llamapipe.cli:main"}


@pytest.mark.slow
def test_installed_wheel_imports_outside_the_repository_next_to_a_data_folder(wheel, tmp_path):
    """A fresh, isolated venv (not --system-site-packages: an editable install of the checkout there would
    shadow the wheel through its import hook), the wheel installed with --no-deps, run from a directory that
    has its own `data/` package: `llamapipe` comes from the venv's site-packages, `llamapipe.data` is ours and
    the user's `data` stays theirs. The modules imported need no dependency, so nothing is downloaded."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # without PYTHONPATH (other tests put the checkout there, whose egg-info would make pip skip the install)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel],
                             capture_output=True, text=True, timeout=300, env=env)
    assert install.returncode == 0, install.stdout + install.stderr
    user_dir = tmp_path / "project"
    (user_dir / "data").mkdir(parents=True)
    (user_dir / "data" / "__init__.py").write_text("OWNER = 'user'\n")
    code = ("import sysconfig, data, llamapipe, llamapipe.cli, llamapipe.data as g\n"
            "site = sysconfig.get_paths()['purelib']\n"
            "print(llamapipe.__file__.startswith(site), g.__file__.startswith(site), data.OWNER)\n")
    out = subprocess.run([str(python), "-c", code], cwd=user_dir, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "user"]
    command = subprocess.run([str(venv / "bin" / "llamapipe"), "--help"], cwd=user_dir, capture_output=True,
                             text=True, timeout=300, env=env)
    assert command.returncode == 0 and "plot-schedule" in command.stdout


def test_scripts_holds_only_shell_launchers_that_parse():
    """The Python tools moved into llamapipe/tools (`llamapipe <subcommand>`); scripts/ keeps launchers."""
    scripts = sorted(os.listdir(os.path.join(ROOT, "scripts")))
    assert scripts and all(name.endswith((".sh", ".sbatch")) for name in scripts), scripts
    for name in scripts:
        path = os.path.join(ROOT, "scripts", name)
        assert subprocess.run(["bash", "-n", path]).returncode == 0, name
        with open(path) as f:
            assert not re.search(r"scripts/\w+\.py", f.read()), f"{name} calls a moved scripts/*.py tool"
