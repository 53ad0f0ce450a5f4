"""Pretrain LLaMA with tensor, pipeline, virtual-pipeline and data parallelism (Megatron-LM's flags).

    torchrun --nproc_per_node 4 pretrain_llama.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --mock-data --train-iters 10

The thin entry point users launch; the work is in llamapipe.train (also `torchrun -m llamapipe.train`).
"""
from llamapipe.process_exit import exit_process
from llamapipe.train import main

if __name__ == "__main__":
    exit_process(main())      # without the interpreter's 1.3 s teardown of torch (llamapipe/process_exit.py)
