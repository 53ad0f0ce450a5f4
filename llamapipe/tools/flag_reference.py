"""Write docs/flags.md, the reference of every `pretrain_llama.py` flag, from the argument parser itself.

    llamapipe flag-reference                 (writes docs/flags.md; run it from the repository root)
    llamapipe flag-reference --check         (exit 1 when docs/flags.md is out of date)

Why: a hand-kept list drifts from the parser; this one is rendered from `build_parser()` (every group,
every flag, its default and help line) and tests/unit/test_docs.py fails when the committed page differs
from a fresh render. The output depends only on the parser, so rendering twice gives the same bytes.
"""
from __future__ import annotations

import argparse
import os
import sys

from llamapipe.training.flag_parser import FlagParser
from llamapipe.safe_files import replace_atomically
from llamapipe.training.arguments import build_parser

HEADER = """# Flag reference

Every flag of `pretrain_llama.py` (also `torchrun -m llamapipe.train`), grouped as in `--help`, with its
default and help line. Generated from the argument parser by `llamapipe flag-reference`; do not edit by
hand (tests/unit/test_docs.py fails when this page is out of date). The flags are Megatron-LM's names.

Every inconsistent combination is rejected before any process group is created, by rank 0, as one
sentence naming the flags and the numbers, with exit status 2:

```
$ torchrun --nproc_per_node 4 pretrain_llama.py --mock-data --tensor-model-parallel-size 3
pretrain_llama.py: error: world size 4 is not divisible by --tensor-model-parallel-size (3) x --pipeline-model-parallel-size (1)
```

Under `torchrun` that line comes first, every worker exits with status 2, and torchrun then adds its own
report of the failed workers (and exits 1); no worker prints a traceback. What the flags do, concern by
concern, is in the pages listed in the [README](../README.md#documentation).
"""


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.nargs == 0:
        return "on" if action.default else "off"
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    return f"`{value}`".replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:   # argparse's own placeholders, e.g. %(default)s, expanded as --help does
        params = {k: getattr(v, "__name__", v) for k, v in vars(action).items()}
        text = text % dict(params, prog=prog)
    if action.choices is not None and not any(str(c) in text for c in action.choices):
        text = (text + " " if text else "") + "One of " + ", ".join(f"`{c}`" for c in action.choices) + "."
    return " ".join(text.split()).replace("|", "\\|")


def render(parser: argparse.ArgumentParser) -> str:
    """The whole page as markdown: one section per argument group, one table row per flag."""
    out = [HEADER]
    for group in parser._action_groups:   # argparse has no public accessor for its groups
        actions = [a for a in group._group_actions
                   if a.option_strings and a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"## {group.title}", ""]
        if group.description:
            out += [" ".join(group.description.split()), ""]
        out += ["| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            flags = ", ".join(f"`{s}`" for s in a.option_strings)
            out.append(f"| {flags} | {_default(a)} | {_help(a, parser.prog)} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = FlagParser(prog="llamapipe flag-reference", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("docs", "flags.md"), help="page to write (default docs/flags.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out is out of date")
    args = p.parse_args(argv)
    text = render(build_parser())
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"{args.out} is out of date: run `llamapipe flag-reference`", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with replace_atomically(args.out, "w") as f:     # never through a link (llamapipe/safe_files)
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
