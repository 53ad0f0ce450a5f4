#!/usr/bin/env bash
# Megatron-LM <-> llamapipe round trip: import a Megatron torch_dist save at tp 2 x pp 2, export it back.
#   bash examples/megatron/round_trip.sh MEGATRON_SAVE_DIR WORK_DIR
# WORK_DIR/ours is our checkpoint, WORK_DIR/megatron the Megatron save directory written back
# (load it in Megatron-LM with --load WORK_DIR/megatron --ckpt-format torch_dist).
set -euo pipefail
MEGATRON=${1:?usage: round_trip.sh MEGATRON_SAVE_DIR WORK_DIR}
WORK=${2:?usage: round_trip.sh MEGATRON_SAVE_DIR WORK_DIR}
PY=${PYTHON:-python3}
"$PY" -m llamapipe convert-megatron import --load "$MEGATRON" --save "$WORK/ours" \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
"$PY" -m llamapipe convert-megatron export --load "$WORK/ours" --save "$WORK/megatron"
