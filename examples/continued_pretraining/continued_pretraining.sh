#!/usr/bin/env bash
# Continued pretraining of a Llama 3.2 1B checkpoint (docs/continued_pretraining.md): import the HF checkpoint,
# pack a corpus with its tokenizer, train at tp 2 x pp 2 under the ZB-V zero-bubble schedule with packed
# documents that do not attend to each other, export back to HF, and generate with transformers.
#
#   HF_CHECKPOINT=/path/to/Llama-3.2-1B bash examples/continued_pretraining/continued_pretraining.sh
#
# HF_CHECKPOINT is a transformers directory (config.json, model.safetensors, tokenizer.json), e.g. a download of
# meta-llama/Llama-3.2-1B; the model's shape is read from its config.json. Without HF_CHECKPOINT the script
# first writes a random-weight checkpoint of Llama 3.2 1B's shape with a tokenizer trained on the corpus, so
# the recipe runs offline; its shape shrinks through NUM_LAYERS, HIDDEN_SIZE, FFN_HIDDEN_SIZE, NUM_HEADS,
# NUM_KV_HEADS, VOCAB_SIZE, MAX_POSITION_EMBEDDINGS and TOKENIZER_VOCAB, e.g. (about a minute on 2 CPU cores; a
# random model learns fast, hence the higher LR):
#
#   NUM_LAYERS=4 HIDDEN_SIZE=64 FFN_HIDDEN_SIZE=256 NUM_HEADS=4 NUM_KV_HEADS=2 VOCAB_SIZE=1024 \
#   MAX_POSITION_EMBEDDINGS=16384 TOKENIZER_VOCAB=512 CORPUS_MB=0.5 SEQ_LENGTH=128 TRAIN_ITERS=8 LR=3e-3 \
#       bash examples/continued_pretraining/continued_pretraining.sh
#
# MAX_POSITION_EMBEDDINGS stays above 8192, the RoPE scaling's original_max_position_embeddings (the context
# before scaling, which training fixes at 8192 as Megatron's --use-rope-scaling does); its cos/sin tables are
# small at a shrunk head size.
#
# Other knobs: CORPUS (a directory or files of {"text": ...} jsonl/parquet records; default: a sample corpus
# made from text on this machine), RUN_DIR (runs/continued_pretraining), SEQ_LENGTH (4096), MICRO_BATCH_SIZE
# (1), GLOBAL_BATCH_SIZE (8), TRAIN_ITERS (100), LR (3e-5), MASTER_PORT, PYTHON. Each run starts over in RUN_DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
RUN=${RUN_DIR:-runs/continued_pretraining}
rm -rf "$RUN" && mkdir -p "$RUN"

echo "== 1/6 corpus -> $RUN/corpus"
CORPUS=${CORPUS:-}
if [ -z "$CORPUS" ]; then
  CORPUS="$RUN/corpus"
  "$PY" -m llamapipe make-sample-corpus --out "$CORPUS" --max-mb "${CORPUS_MB:-4}"
fi

HF=${HF_CHECKPOINT:-}
if [ -z "$HF" ]; then
  HF="$RUN/random-llama-3.2-1b"
  echo "== 2/6 no HF_CHECKPOINT: a random-weight checkpoint of Llama 3.2 1B's shape -> $HF"
  "$PY" -m llamapipe train-tokenizer --tokenizer-type HuggingFaceTokenizer --input "$CORPUS" \
    --vocab-size "${TOKENIZER_VOCAB:-8192}" --model-prefix "$HF"
  # Llama 3.2 1B's config.json (meta-llama/Llama-3.2-1B): Llama 3.1's RoPE scaling (rope_type llama3, factor 32)
  # and the input embedding tied to the output layer.
  "$PY" - "$HF" <<'PY'
import os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from llamapipe.data.tokenizer import build_tokenizer
out = sys.argv[1]
tokenizer = build_tokenizer(out)
env = lambda name, default: int(os.environ.get(name, default))
ORIGINAL = 8192     # Llama 3.2's original_max_position_embeddings, the only value training sets
if env("MAX_POSITION_EMBEDDINGS", 131072) <= ORIGINAL:
    sys.exit(f"continued_pretraining: MAX_POSITION_EMBEDDINGS {env('MAX_POSITION_EMBEDDINGS', 131072)} must exceed "
             f"{ORIGINAL}, the RoPE scaling's original_max_position_embeddings; give 16384 for a shrunk run")
config = LlamaConfig(num_hidden_layers=env("NUM_LAYERS", 16), hidden_size=env("HIDDEN_SIZE", 2048),
                     intermediate_size=env("FFN_HIDDEN_SIZE", 8192), num_attention_heads=env("NUM_HEADS", 32),
                     num_key_value_heads=env("NUM_KV_HEADS", 8), vocab_size=env("VOCAB_SIZE", 128256),
                     max_position_embeddings=env("MAX_POSITION_EMBEDDINGS", 131072),
                     rope_parameters={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                      "rope_theta": 500000.0},
                     rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, initializer_range=0.02,
                     bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(out)
print(f"wrote {out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary {config.vocab_size}")
PY
else
  echo "== 2/6 HF checkpoint $HF"
fi
VOCAB=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$HF/config.json")

echo "== 3/6 pack the corpus with the checkpoint's tokenizer (an end-of-document token after each) -> $RUN/data"
"$PY" -m llamapipe preprocess --input "$CORPUS" --output-prefix "$RUN/data/corpus" --tokenizer-model "$HF" \
  --workers 2 --append-eod --no-progress

echo "== 4/6 import into tp 2 x pp 2 with two virtual stages per rank (ZB-V's V) -> $RUN/base"
"$PY" -m llamapipe convert-hf import --hf-dir "$HF" --save "$RUN/base" --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2

echo "== 5/6 continued pretraining: torchrun, 4 processes, tp 2 pp 2, zbv, packed documents -> $RUN/checkpoints"
PRECISION=$("$PY" -c "import torch; print('--bf16' if torch.cuda.is_available() else '')")
# the shape comes from the checkpoint (--use-checkpoint-args), the vocabulary from config.json (it may exceed
# the tokenizer's); --finetune loads the weights and starts at iteration 0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m torch.distributed.run --nproc_per_node 4 \
  --master_port "${MASTER_PORT:-29531}" pretrain_llama.py \
  --load "$RUN/base" --use-checkpoint-args --finetune --vocab-size "$VOCAB" \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
  --num-virtual-stages-per-pipeline-rank 2 --pipeline-schedule zbv \
  --data-path "$RUN/data/corpus_text_document" --tokenizer-model "$HF" --split 98,2,0 \
  --reset-position-ids --reset-attention-mask --eod-mask-loss \
  --seq-length "${SEQ_LENGTH:-4096}" --micro-batch-size "${MICRO_BATCH_SIZE:-1}" \
  --global-batch-size "${GLOBAL_BATCH_SIZE:-8}" --train-iters "${TRAIN_ITERS:-100}" \
  --lr "${LR:-3e-5}" --min-lr "$("$PY" -c "print(${LR:-3e-5} / 10)")" --lr-warmup-fraction 0.1 \
  --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  $PRECISION --eval-interval "${TRAIN_ITERS:-100}" --eval-iters 1 --log-interval 1 --num-workers 1 \
  --metrics-jsonl "$RUN/metrics.jsonl" --save "$RUN/checkpoints" --save-interval "${TRAIN_ITERS:-100}"

echo "== 6/6 export to HF (weights, config.json, tokenizer) -> $RUN/hf, and generate with transformers"
"$PY" -m llamapipe convert-hf export --load "$RUN/checkpoints" --hf-dir "$RUN/hf"
"$PY" - "$HF" "$RUN/hf" <<'PY'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
base, out = (AutoConfig.from_pretrained(d).to_dict() for d in sys.argv[1:])
keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "max_position_embeddings", "rope_parameters", "rms_norm_eps", "tie_word_embeddings")
changed = {k: (base.get(k), out.get(k)) for k in keys if base.get(k) != out.get(k)}
if changed:
    sys.exit(f"continued_pretraining: the export's shape differs from the checkpoint's: {changed}")
tok = AutoTokenizer.from_pretrained(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
torch.manual_seed(0)
ids = model.generate(**tok("The", return_tensors="pt"), max_new_tokens=16, do_sample=True, top_k=40)
print("continued_pretraining: the export keeps the checkpoint's shape; transformers generates:",
      repr(tok.decode(ids[0], skip_special_tokens=True)))
PY
echo "metrics: $RUN/metrics.jsonl   checkpoints: $RUN/checkpoints   HF export: $RUN/hf"
