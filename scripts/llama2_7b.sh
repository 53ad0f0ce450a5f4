#!/usr/bin/env bash
# LLaMA2-7B on RedPajama, 8 GPUs per node: tp=4, pp=2, 4 layers per virtual stage (4 chunks per rank),
# interleaved 1F1B. Set NNODES/NODE_RANK/MASTER_ADDR for several nodes (dp = world / 8).
#   DATA=/data/redpajama_text_document TOKENIZER=/models/llama2/tokenizer.model bash scripts/llama2_7b.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to a preprocessed prefix (llamapipe preprocess)}"
: "${TOKENIZER:?set TOKENIZER to the sentencepiece model}"
CKPT=${CKPT:-checkpoints/llama2-7b}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
exec bash scripts/launch_multi_node.sh \
  --model llama2-7b \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \
  --num-layers-per-virtual-pipeline-stage 4 --sequence-parallel \
  --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-512}" --seq-length 4096 \
  --train-iters "${TRAIN_ITERS:-250000}" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine \
  --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --recompute-granularity selective \
  --data-path "$DATA" --tokenizer-model "$TOKENIZER" --split 969,30,1 \
  --save "$CKPT" --load "$CKPT" --save-interval 1000 --exit-signal-handler \
  --eval-interval 1000 --eval-iters 10 --log-interval 10 \
  --tensorboard-dir "$CKPT/tensorboard" --metrics-jsonl "$CKPT/metrics.jsonl" "$@"
