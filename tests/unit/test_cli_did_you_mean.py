"""Issue 33 for every `llamapipe` subcommand: a mistyped flag prints exactly the one-line usage and one error
line naming the closest flag (llamapipe/training/flag_parser.py), not argparse's usage of every flag; a mistyped
subcommand name gets the closest subcommand. Run in this process through `llamapipe.cli.main`."""
import sys

import pytest

from llamapipe import cli

# subcommand -> (its words with one mistyped flag, the mistyped flag, the flag it should suggest); no typo is a
# prefix of a flag, so a parser that still takes abbreviations fails here instead of running the tool
MISTYPED = {
    "train": (["train", "--mock-data", "--pipeline-parallel-size", "2"], "--pipeline-parallel-size",
              "--pipeline-model-parallel-size"),
    "make-sample-corpus": (["make-sample-corpus", "--max-mbs", "1"], "--max-mbs", "--max-mb"),
    "train-tokenizer": (["train-tokenizer", "--vocab-sise", "300"], "--vocab-sise", "--vocab-size"),
    "preprocess": (["preprocess", "--input", "x.jsonl", "--output-prefx", "out"], "--output-prefx",
                   "--output-prefix"),
    "convert-hf": (["convert-hf", "import", "--hf-dirr", "x", "--save", "y"], "--hf-dirr", "--hf-dir"),
    "convert-megatron": (["convert-megatron", "import", "--loda", "x", "--save", "y"], "--loda", "--load"),
    "plot-schedule": (["plot-schedule", "--schedule", "1f1b", "--microbatchs", "4"], "--microbatchs",
                      "--microbatches"),
    "plot-trace": (["plot-trace", "t.json", "--iteratoin", "3"], "--iteratoin", "--iteration"),
    "verify-checkpoint": (["verify-checkpoint", "ckpt", "--wokers", "2"], "--wokers", "--workers"),
    "plan": (["plan", "--model", "tiny", "--gpsu", "8"], "--gpsu", "--gpus"),
    "profile": (["profile", "--out", "p.json", "--repaets", "2"], "--repaets", "--repeats"),
    "flag-reference": (["flag-reference", "--chek"], "--chek", "--check"),
    "dry-run": (["dry-run", "--world-size", "8", "--mock-data", "--gpu-memroy-gb", "40"], "--gpu-memroy-gb",
                "--gpu-memory-gb"),
}
CASES = [pytest.param(*case, id=name) for name, case in MISTYPED.items()]


def test_every_subcommand_has_a_case():
    assert set(MISTYPED) == set(cli.SUBCOMMANDS)


@pytest.mark.parametrize("argv, flag, suggestion", CASES)
def test_mistyped_flag_is_the_usage_line_and_one_error_line(argv, flag, suggestion, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)                               # nothing is written, but if it were: not here
    monkeypatch.setattr(sys, "argv", ["llamapipe"] + argv)   # cli.main renames sys.argv[0]
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == "" and len(lines) == 2, out.err
    assert lines[0].startswith("usage: ") and "--help" in lines[0]
    assert lines[1].endswith(f": error: unrecognized argument {flag}; did you mean {suggestion}?"), lines[1]


def test_mistyped_subcommand_names_the_closest_one(capsys):
    assert cli.main(["preprocss", "--input", "x"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines()[1:] == [
        "llamapipe: error: unknown subcommand 'preprocss'; did you mean preprocess?"]
    assert len(out.err.splitlines()) == 2 and out.err.startswith("usage: llamapipe <subcommand>")
    assert cli.main(["qqqq"]) == 2
    assert capsys.readouterr().err.splitlines()[1].endswith(f"choose one of {', '.join(cli.SUBCOMMANDS)}")


def test_unknown_flags_are_only_what_argparse_takes_for_flags(capsys):
    from llamapipe.training.flag_parser import FlagParser
    p = FlagParser(prog="t")
    p.add_argument("--scale", type=float)
    p.add_argument("words", nargs="*")
    args = p.parse_args(["--scale", "-1.5", "-3", "two words", "--", "--not-a-flag"])
    assert args.scale == -1.5 and args.words == ["-3", "two words", "--not-a-flag"]
    assert p.unknown_flags(["--scale=-2", "-", "--scal", "--", "--after"]) == ["--scal"]
    with pytest.raises(SystemExit):
        p.parse_args(["--scal=2", "--requred"])        # both named, the close one with its suggestion
    assert capsys.readouterr().err.splitlines() == [
        "usage: t WORDS [flags]   (--help lists every flag)",
        "t: error: unrecognized arguments --scal=2 (did you mean --scale?), --requred"]
