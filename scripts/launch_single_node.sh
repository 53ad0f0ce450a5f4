#!/usr/bin/env bash
# One node, all its GPUs (or CPU processes): torchrun standalone rendezvous.
#   GPUS_PER_NODE=8 bash scripts/launch_single_node.sh --model llama2-7b --tensor-model-parallel-size 4 ...
# Every argument is passed to pretrain_llama.py. Without GPUs, e.g. (2 CPU processes, the tiny preset, ZB-V):
#   GPUS_PER_NODE=2 bash scripts/launch_single_node.sh --mock-data --pipeline-model-parallel-size 2 --pipeline-schedule zbv --global-batch-size 4 --train-iters 5
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${GPUS_PER_NODE:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_llama.py "$@"
