#!/usr/bin/env bash
# README command one: install, build a real-text sample corpus, train a tokenizer, preprocess it, then
# pretrain a tiny LLaMA on 4 CPU processes with tp=2, pp=2, two virtual stages per rank and the ZB-V
# zero-bubble schedule, and export it to HF transformers, which generates text from the export alone.
# About a minute on 2 cores once installed; the loss visibly falls.
#
# Run it again to resume: the corpus, tokenizer and .bin/.idx already built are kept, training continues
# from the newest checkpoint in $RUN_DIR/checkpoints (--load) up to TRAIN_ITERS, metrics.jsonl grows, and
# TensorBoard gets a new directory per run under $RUN_DIR/tensorboard. FRESH=1 deletes $RUN_DIR first.
#   TRAIN_ITERS=120 bash scripts/quickstart.sh        # 40 more iterations after the default 80
# Knobs: RUN_DIR (runs/quickstart), TRAIN_ITERS (80), FRESH=1, SKIP_INSTALL=1, MASTER_PORT, PYTHON,
# TORCH_INDEX_URL (see scripts/install.sh: torch comes from PyTorch's CPU index by default).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=${RUN_DIR:-runs/quickstart}
ITERS=${TRAIN_ITERS:-80}
CKPT="$RUN/checkpoints"
[ "${FRESH:-0}" = 1 ] && rm -rf "$RUN"
mkdir -p "$RUN"
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh   # quick when already installed from this checkout

echo "== 1/5 sample corpus (real text from this machine, RedPajama format) -> $RUN/corpus"
if [ -d "$RUN/corpus" ]; then echo "kept (FRESH=1 rebuilds)"; else
  "$PY" -m llamapipe make-sample-corpus --out "$RUN/corpus" --max-mb 4
fi
echo "== 2/5 sentencepiece tokenizer -> $RUN/tokenizer.model"
if [ -f "$RUN/tokenizer.model" ]; then echo "kept"; else
  "$PY" -m llamapipe train-tokenizer --input "$RUN/corpus" --vocab-size 2048 --model-prefix "$RUN/tokenizer"
fi
echo "== 3/5 preprocess to Megatron .bin/.idx -> $RUN/data/corpus_text_document"
if [ -f "$RUN/data/corpus_text_document.idx" ]; then echo "kept"; else
  "$PY" -m llamapipe preprocess --input "$RUN/corpus" --output-prefix "$RUN/data/corpus" \
    --tokenizer-model "$RUN/tokenizer.model" --workers 2 --append-eod
fi

LOAD=()
DONE=0
if [ -f "$CKPT/latest_checkpointed_iteration.txt" ]; then
  DONE=$(cat "$CKPT/latest_checkpointed_iteration.txt")
  LOAD=(--load "$CKPT" --override-opt_param-scheduler)   # the schedule follows the new TRAIN_ITERS
fi
if [ "$DONE" -ge "$ITERS" ]; then
  echo "== 4/5 pretrain: the checkpoint in $CKPT is at iteration $DONE, nothing to train (raise TRAIN_ITERS, or FRESH=1)"
else
  echo "== 4/5 pretrain: torchrun, 4 processes, tp=2 pp=2 vpp=2, zbv schedule, iterations $((DONE + 1))-$ITERS"
  [ "$DONE" -gt 0 ] && echo "resuming from the checkpoint at iteration $DONE in $CKPT"
  [ "$DONE" -gt 0 ] || rm -f "$RUN/metrics.jsonl"
  # Every value the run relies on is given, so changes of the defaults do not change the quickstart.
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc_per_node 4 --master_port "${MASTER_PORT:-29517}" \
    pretrain_llama.py --model tiny \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers-per-virtual-pipeline-stage 2 --pipeline-schedule zbv \
    --micro-batch-size 4 --global-batch-size 16 --seq-length 128 \
    --train-iters "$ITERS" --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
    --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --seed 1234 \
    --data-path "$RUN/data/corpus_text_document" --tokenizer-model "$RUN/tokenizer.model" \
    --split 98,2,0 --eval-interval 40 --eval-iters 2 --log-interval 10 \
    --tensorboard-dir "$RUN/tensorboard/$(date +%Y%m%d-%H%M%S)" --metrics-jsonl "$RUN/metrics.jsonl" \
    --save "$CKPT" --save-interval 40 ${LOAD[@]+"${LOAD[@]}"}
fi

# Single iterations are noisy: compare the mean loss of the first and the last (up to) 10 iterations.
"$PY" - "$RUN/metrics.jsonl" <<'PY'
import json, sys
by_iter = {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    if "lm_loss" in row:
        by_iter[row["iteration"]] = row["lm_loss"]   # a resumed run repeats iterations: the newest wins
iters = sorted(by_iter)
n = min(10, len(iters) // 2)
if n == 0:
    sys.exit("quickstart: fewer than 2 logged iterations in " + sys.argv[1])
first, last = iters[:n], iters[-n:]
mean = lambda its: sum(by_iter[i] for i in its) / len(its)
before, after = mean(first), mean(last)
print(f"quickstart: mean lm loss {before:.3f} over iterations {first[0]}-{first[-1]} -> {after:.3f} over "
      f"iterations {last[0]}-{last[-1]} ({'falling' if after < before else 'NOT falling'})")
sys.exit(0 if after < before else 1)
PY
echo "== 5/5 export to HF transformers (weights, config, tokenizer) -> $RUN/hf, then generate from it alone"
"$PY" -m llamapipe convert-hf export --load "$CKPT" --hf-dir "$RUN/hf"
"$PY" - "$RUN/hf" <<'PY'
import sys
import torch
from transformers import AutoTokenizer, LlamaForCausalLM
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = LlamaForCausalLM.from_pretrained(sys.argv[1])
torch.manual_seed(0)   # sampled: greedy decoding of a model this small repeats one newline token
out = model.generate(**tok("Return the", return_tensors="pt"), max_new_tokens=24, do_sample=True, top_k=40,
                     temperature=0.8)
print("quickstart: transformers generates from the export (80 iterations of a tiny model: expect word salad):",
      repr(tok.decode(out[0], skip_special_tokens=True)))
PY
echo "metrics:     $RUN/metrics.jsonl"
echo "tensorboard: tensorboard --logdir $RUN/tensorboard   (one directory per run)"
echo "checkpoints: $CKPT   (run again with a larger TRAIN_ITERS to resume)"
echo "HF export:   $RUN/hf   (AutoTokenizer / LlamaForCausalLM.from_pretrained)"
