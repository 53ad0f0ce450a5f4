"""Pretrain LLaMA: parse -> validate -> init distributed -> build -> train.

    torchrun --nproc_per_node 4 pretrain_llama.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --mock-data --train-iters 10
    torchrun --nproc_per_node 4 -m llamapipe.train ...        (the same, from an installed package)
"""
from __future__ import annotations

import sys

from llamapipe.training.arguments import parse_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:     # the job checked on fake process groups and meta tensors instead (issue 41)
        from llamapipe.training.dry_run.main import main as dry_run
        return dry_run(argv)
    config = parse_args(argv)  # exits 2 with one plain line on any inconsistent flag combination
    from llamapipe.training.startup import log_startup
    log_startup(config)
    from llamapipe.training.pretrain import pretrain
    return pretrain(config)


if __name__ == "__main__":
    from llamapipe.process_exit import exit_process
    exit_process(main())      # without the interpreter's teardown of torch (llamapipe/process_exit.py)
