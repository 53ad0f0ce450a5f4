#!/usr/bin/env bash
# README command one: install, build a real-text sample corpus, train a tokenizer, preprocess it, then
# pretrain a tiny LLaMA on 4 CPU processes with tp=2, pp=2, two virtual stages per rank and the ZB-V
# zero-bubble schedule. A few minutes on 2 cores; the loss visibly falls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=${RUN_DIR:-runs/quickstart}
ITERS=${TRAIN_ITERS:-80}
mkdir -p "$RUN"
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh

echo "== 1/4 sample corpus (real text from this machine, RedPajama format) -> $RUN/corpus"
"$PY" scripts/make_sample_corpus.py --out "$RUN/corpus" --max-mb 4
echo "== 2/4 sentencepiece tokenizer -> $RUN/tokenizer.model"
"$PY" scripts/train_tokenizer.py --input "$RUN/corpus" --vocab-size 2048 --model-prefix "$RUN/tokenizer"
echo "== 3/4 preprocess to Megatron .bin/.idx -> $RUN/data/corpus_text_document"
"$PY" scripts/preprocess_data.py --input "$RUN/corpus" --output-prefix "$RUN/data/corpus" \
  --tokenizer-model "$RUN/tokenizer.model" --workers 2 --append-eod
echo "== 4/4 pretrain: torchrun, 4 processes, tp=2 pp=2 vpp=2, zbv schedule, $ITERS iterations"
rm -f "$RUN/metrics.jsonl"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc_per_node 4 --master_port "${MASTER_PORT:-29517}" \
  pretrain_llama.py --model tiny \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --num-layers-per-virtual-pipeline-stage 2 --pipeline-schedule zbv \
  --micro-batch-size 4 --global-batch-size 16 --seq-length 128 \
  --train-iters "$ITERS" --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
  --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
  --data-path "$RUN/data/corpus_text_document" --tokenizer-model "$RUN/tokenizer.model" \
  --split 98,2,0 --eval-interval 40 --eval-iters 2 \
  --log-interval 10 --tensorboard-dir "$RUN/tensorboard" --metrics-jsonl "$RUN/metrics.jsonl" \
  --save "$RUN/checkpoints" --save-interval 40

"$PY" - "$RUN/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"lm_loss"' in line]
first, last = rows[0]["lm_loss"], rows[-1]["lm_loss"]
print(f"quickstart: lm loss {first:.3f} at iteration {rows[0]['iteration']} -> {last:.3f} at iteration "
      f"{rows[-1]['iteration']} ({'falling' if last < first else 'NOT falling'})")
sys.exit(0 if last < first else 1)
PY
echo "metrics:     $RUN/metrics.jsonl"
echo "tensorboard: tensorboard --logdir $RUN/tensorboard"
echo "checkpoints: $RUN/checkpoints"
