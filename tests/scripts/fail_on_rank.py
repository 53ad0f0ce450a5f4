"""Test-only launcher: pretrain_llama.py with a fault on one rank only (the other ranks must stop quietly).

    torchrun ... tests/scripts/fail_on_rank.py --fail-rank 1 --fail-in train -- <pretrain_llama.py flags>
--fail-in data: building the data iterators raises a ValueError (an unreadable shard on one node);
--fail-in train: the second microbatch of the second training step raises an OSError (a read error on one
node) in the middle of the pipeline schedule, with receives posted and the other ranks waiting on messages.
"""
import errno
import os
import sys

import llamapipe.training.loop as training
import llamapipe.training.step as step
from llamapipe.train import main as pretrain_main


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    rank = int(argv[argv.index("--fail-rank") + 1])
    where = argv[argv.index("--fail-in") + 1]
    mine = int(os.environ["RANK"]) == rank
    original_iterators, original_forward = training.build_iterators, step.forward_step
    forwards = []

    def build_iterators(*args, **kwargs):
        if mine and where == "data":
            raise ValueError("--data-path shard /data/shard_07.bin: cannot read it on this node (injected)")
        return original_iterators(*args, **kwargs)

    def forward_step(data_iterator, model):
        forwards.append(None)
        if mine and where == "train" and len(forwards) == 6:    # 4 microbatches per step
            raise OSError(errno.EIO, "reading /data/shard_07.bin: Input/output error (injected)")
        return original_forward(data_iterator, model)

    training.build_iterators, step.forward_step = build_iterators, forward_step
    return pretrain_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
