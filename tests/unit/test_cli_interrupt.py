"""The `llamapipe` entry handles Ctrl-C and a refused path once for every subcommand (issue 51, item 8): one
line, exit 130 for the interrupt (the shell's code for SIGINT, as the trainer ends), no traceback."""
from __future__ import annotations

import importlib

import pytest

from llamapipe import cli
from llamapipe.safe_files import UnsafePathError


@pytest.mark.parametrize("name", ["dry-run", "convert-hf", "plot-trace"])
def test_ctrl_c_in_a_subcommand_is_one_line_and_exit_130(name, capsys, monkeypatch):
    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module(cli.SUBCOMMANDS[name][0]), "main", interrupted)
    assert cli.main([name, "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == f"llamapipe {name}: interrupted (Ctrl-C); stopped" and "Traceback" not in err


def test_a_refused_path_is_one_line(capsys, monkeypatch):
    def refused(argv):
        raise UnsafePathError("out.json is a symbolic link; llamapipe writes only regular files")
    monkeypatch.setattr(importlib.import_module(cli.SUBCOMMANDS["profile"][0]), "main", refused)
    assert cli.main(["profile", "--out", "out.json", "--force"]) == 2
    assert capsys.readouterr().err == "llamapipe profile: error: out.json is a symbolic link; llamapipe writes only regular files\n"


def test_profile_refuses_a_link_as_out_before_it_measures(tmp_path, capsys):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "victim.json")
    with pytest.raises(SystemExit) as stop:
        cli.main(["profile", "--model", "tiny", "--out", str(link), "--force"])
    assert "is a symbolic link" in str(stop.value.code) and not (tmp_path / "victim.json").exists()
