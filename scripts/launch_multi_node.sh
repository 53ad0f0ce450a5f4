#!/usr/bin/env bash
# Multi-node torchrun with c10d rendezvous. Run the same command on every node:
#   MASTER_ADDR=node0 MASTER_PORT=29500 NNODES=2 NODE_RANK=<0|1> GPUS_PER_NODE=8 \
#     bash scripts/launch_multi_node.sh --model llama2-7b ...
# MAX_RESTARTS>0 lets torchrun restart failed workers; pass --save DIR --load DIR so they resume.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC=${GPUS_PER_NODE:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
# On SIGTERM torchrun waits this long for workers before SIGKILL: room for --exit-signal-handler to
# finish the iteration and save (torch's default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
exec python3 -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${RDZV_ID:-llamapipe}" \
  --max_restarts "${MAX_RESTARTS:-0}" \
  pretrain_llama.py "$@"
