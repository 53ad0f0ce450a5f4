"""The `llamapipe` command: one entry point for the tools, `llamapipe <subcommand> [flags]`.

    llamapipe preprocess --input corpus --output-prefix data/corpus --tokenizer-model tok.model
    llamapipe plot-schedule --schedule zbv --pp 4 --microbatches 8 --out runs/zbv.png

Training itself is launched with torchrun (`torchrun pretrain_llama.py ...` or `torchrun -m llamapipe.train ...`);
`llamapipe train` runs it in this one process, which is handy for a quick check.
"""
from __future__ import annotations

import importlib
import sys

from llamapipe.safe_files import UnsafePathError
from llamapipe.training.flag_parser import closest

# subcommand -> (module, one-line summary)
SUBCOMMANDS = {
    "train": ("llamapipe.train", "pretrain in this process (use torchrun for several)"),
    "make-sample-corpus": ("llamapipe.tools.make_sample_corpus",
                           "a small RedPajama-format corpus from text already on this machine"),
    "train-tokenizer": ("llamapipe.tools.train_tokenizer", "train a sentencepiece or BPE tokenizer on a corpus"),
    "preprocess": ("llamapipe.tools.preprocess_data", "tokenize jsonl/parquet into Megatron .bin/.idx"),
    "convert-hf": ("llamapipe.tools.convert_hf", "import / export HF transformers LLaMA checkpoints"),
    "convert-megatron": ("llamapipe.tools.convert_megatron", "import / export Megatron-LM torch_dist checkpoints"),
    "plot-schedule": ("llamapipe.tools.plot_schedule", "draw and simulate a pipeline schedule"),
    "plot-trace": ("llamapipe.tools.plot_trace", "draw a --pipeline-trace beside its simulated plan, list late actions"),
    "verify-checkpoint": ("llamapipe.tools.verify_checkpoint", "check a checkpoint's files against its checksums"),
    "plan": ("llamapipe.tools.plan_parallelism", "rank the parallel layouts that fit a model on a cluster"),
    "dry-run": ("llamapipe.training.dry_run.main",
                "check a job of N ranks on this machine: every rank's setup and a step on meta tensors"),
    "profile": ("llamapipe.tools.profile_model",
                "measure F/B/W time and memory per layer (and comm under torchrun) for plan --profile"),
    "flag-reference": ("llamapipe.tools.flag_reference", "write docs/flags.md from the argument parser"),
}


USAGE = "usage: llamapipe <subcommand> [flags]   (llamapipe --help lists the subcommands)\n"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in SUBCOMMANDS.items())
    return f"usage: llamapipe <subcommand> [flags]   (llamapipe <subcommand> --help for its flags)\n\n{rows}\n"


def unknown_subcommand(name: str) -> str:
    """The usage line and one error line: the closest subcommand, or all of them when none is close."""
    near = closest(name, list(SUBCOMMANDS))
    hint = f"did you mean {near}?" if near else f"choose one of {', '.join(SUBCOMMANDS)}"
    return f"{USAGE}llamapipe: error: unknown subcommand {name!r}; {hint}\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        sys.stderr.write(unknown_subcommand(name))
        return 2
    sys.argv[0] = f"llamapipe {name}"
    try:
        return importlib.import_module(SUBCOMMANDS[name][0]).main(rest) or 0
    except KeyboardInterrupt:
        # as the trainer does (training/signals.py): one line, and the shell's code for SIGINT
        sys.stderr.write(f"\nllamapipe {name}: interrupted (Ctrl-C); stopped\n")
        return 130
    except UnsafePathError as err:
        sys.stderr.write(f"llamapipe {name}: error: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
