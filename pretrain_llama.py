"""Pretrain LLaMA with tensor, pipeline, virtual-pipeline and data parallelism.

    torchrun --nproc_per_node 4 pretrain_llama.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --mock-data --train-iters 10

parse -> validate (core/arguments.py) -> init distributed -> build -> train (core/training.py).
"""
from __future__ import annotations

import sys

from core.arguments import parse_args


def main(argv=None) -> int:
    config = parse_args(argv)  # exits 2 with one plain line on any inconsistent flag combination
    from core.training import pretrain
    return pretrain(config)


if __name__ == "__main__":
    sys.exit(main())
