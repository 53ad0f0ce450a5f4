#!/bin/bash
# The zero-bubble fork's examples/pretrain_zero_bubble.sh (sail-sg/zero-bubble-pipeline-parallelism, 39f2c18),
# run through llamapipe's pretrain_llama.py: the same options, the same environment switches
# (ZERO_BUBBLE_V_SCHEDULE, ENABLE_ZERO_BUBBLE, FP32, SYNC_OPTIMIZER, EXTRA_OPTIONS, ...), the same defaults on GPUs.
# What differs:
# - without GPUs (nvidia-smi finds none) it runs 2 CPU processes with CPU-sized defaults: pp 2, tp 1, 4 layers of
#   hidden 64 (4 heads, 2 query groups), seq 128, global batch 4, 80 samples (20 iterations), fp32 (FP32=1; on
#   GPUs the fork's fp16 default stays), the timers' window at iterations 2-4, 2 evaluation iterations;
# - every size the fork hard-codes can be set from the environment (SEQ_LENGTH, MAX_POSITION_EMBEDDINGS, GQA,
#   EVAL_ITERS, TRAIN_SAMPLES, LR_DECAY_SAMPLES, LR_WARMUP_SAMPLES, VOCAB_SIZE), and GQA has a default (8; the
#   fork's script left it unset, so --num-query-groups had no value);
# - the data: the fork's sample dataset when DATASET_DIR holds it, else mock data (--mock-data, VOCAB_SIZE ids);
#   DOWNLOAD=1 fetches the fork's dataset (zb_sample_dataset.tar.gz, from huggingface.co) as the fork always did;
# - there is no nsys branch (PROFILED).
# From the repository root, the fork's quick settings:
#   ZERO_BUBBLE_V_SCHEDULE=1 examples/zero_bubble/pretrain_zero_bubble.sh
#   ZERO_BUBBLE_V_SCHEDULE=1 SYNC_OPTIMIZER=1 EXTRA_OPTIONS="--zero-bubble-v-schedule-mem-setup half" examples/zero_bubble/pretrain_zero_bubble.sh
#   ENABLE_ZERO_BUBBLE=1 examples/zero_bubble/pretrain_zero_bubble.sh
# (ZB-V, V-Half and ZB-2p: the memory limit defaults to 2 x the pipeline size.) A short fp16 run can skip every
# update while the loss scale falls from 2^32; the summary then says so (add --initial-loss-scale 65536 to
# EXTRA_OPTIONS). tests/e2e/test_example_scripts.py runs each line above as written;
# tests/e2e/test_zero_bubble_fork_script.py runs the fork's test_all_schedules.sh settings scaled down.

DIR=`pwd`
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p $DIR/logs

DATASET_DIR=${DATASET_DIR:-'/tmp/zb_sample_dataset'}
DATASET="${DATASET_DIR}/dataset/c4_text_document"
TOKENIZER="${DATASET_DIR}/tokenizers/tokenizer.model"

if [ ! -e "$DATASET"".idx" ] && [ -n "$DOWNLOAD" ]; then
  wget https://huggingface.co/datasets/ufotalent/zero_bubble_sample_dataset/resolve/main/zb_sample_dataset.tar.gz
  tar -xvf zb_sample_dataset.tar.gz -C /tmp
fi

# Running locally
if [ -z "$WORLD_SIZE" ]; then
  export WORLD_SIZE=1
  export RANK=0
  export MASTER_ADDR=localhost
  export MASTER_PORT=${MASTER_PORT:-10086}
fi

ON_CPU=
if [ -z "$GPUS_PER_NODE" ]; then
  GPUS_PER_NODE=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  if [ "$GPUS_PER_NODE" -eq 0 ]; then
    GPUS_PER_NODE=2
    ON_CPU=1
  fi
fi

if [ -n "$ON_CPU" ]; then
  FP32=${FP32-1}
  SEQ_LENGTH=${SEQ_LENGTH:-128}
  MAX_POSITION_EMBEDDINGS=${MAX_POSITION_EMBEDDINGS:-128}
  TRAIN_SAMPLES=${TRAIN_SAMPLES:-80}
  LR_DECAY_SAMPLES=${LR_DECAY_SAMPLES:-80}
  LR_WARMUP_SAMPLES=${LR_WARMUP_SAMPLES:-8}
  EVAL_ITERS=${EVAL_ITERS:-2}
  LOG_INTERVAL=${LOG_INTERVAL:-5}
  TP_SIZE=${TP_SIZE:-1}
  VOCAB_SIZE=${VOCAB_SIZE:-1024}
  ZERO_BUBBLE_TIMER_START=${ZERO_BUBBLE_TIMER_START:-2}
  ZERO_BUBBLE_TIMER_END=${ZERO_BUBBLE_TIMER_END:-4}
fi

if [ -z "$EXIT_INTERVAL" ]; then
  EXIT_INTERVAL=1000
fi

if [ -z "$LOG_INTERVAL" ]; then
  LOG_INTERVAL=10
fi

WORLD_SIZE_IN_GPUS=$(( $WORLD_SIZE * $GPUS_PER_NODE ))

if [ -z "$PIPELINE_SIZE" ] && [ -n "$ON_CPU" ]; then
  PIPELINE_SIZE=2
  LAYERS=4
  MICRO_BATCH_SIZE=1
  GLOBAL_BATCH_SIZE=4
  HIDDEN_SIZE=64
  ATTENTION_HEADS=4
  GQA=${GQA:-2}
  ZERO_BUBBLE_MEM_LIMIT=$((2 * $PIPELINE_SIZE))
elif [ -z "$PIPELINE_SIZE" ]; then
  PIPELINE_SIZE=2
  LAYERS=8
  MICRO_BATCH_SIZE=1
  GLOBAL_BATCH_SIZE=8
  HIDDEN_SIZE=8192
  ATTENTION_HEADS=64
  ZERO_BUBBLE_MEM_LIMIT=$((2 * $PIPELINE_SIZE))
fi
GQA=${GQA:-8}

profile_ranks="0"
for ((i = 1; i < $WORLD_SIZE_IN_GPUS; i++)); do
    profile_ranks="$profile_ranks $i"
done
if [ -z "$ZERO_BUBBLE_TIMER_START" ]; then
  ZERO_BUBBLE_TIMER_START=100
  ZERO_BUBBLE_TIMER_END=110
fi

if [ -z "$EVAL_INTERVAL" ]; then
  EVAL_INTERVAL=10000
fi

if [ -z "$TP_SIZE" ]; then
  TP_SIZE=2
fi

options=" \
  --tensor-model-parallel-size $TP_SIZE \
  --pipeline-model-parallel-size $PIPELINE_SIZE \
  --num-layers $LAYERS \
  --hidden-size $HIDDEN_SIZE \
  --num-attention-heads $ATTENTION_HEADS \
  --exit-interval $EXIT_INTERVAL \
  --seq-length ${SEQ_LENGTH:-4096} \
  --max-position-embeddings ${MAX_POSITION_EMBEDDINGS:-8192} \
  --micro-batch-size $MICRO_BATCH_SIZE \
  --global-batch-size $GLOBAL_BATCH_SIZE \
  --group-query-attention \
  --num-query-groups $GQA \
  --train-samples ${TRAIN_SAMPLES:-146484375} \
  --lr-decay-samples ${LR_DECAY_SAMPLES:-126953125} \
  --lr-warmup-samples ${LR_WARMUP_SAMPLES:-183105} \
  --lr 6.0e-5 \
  --min-lr 6.0e-6 \
  --lr-decay-style cosine \
  --log-interval ${LOG_INTERVAL} \
  --eval-iters ${EVAL_ITERS:-40} \
  --eval-interval $EVAL_INTERVAL \
  --split 98,2,0 \
  --clip-grad 8.0 \
  --weight-decay 0.1 \
  --adam-beta1 0.9 \
  --adam-beta2 0.95 \
  --init-method-std 0.006 \
  --no-barrier-with-level-1-timing \
  --profile-step-start 15 \
  --profile-step-end 17 \
  --untie-embeddings-and-output-weights \
  --use-legacy-models \
  --sequence-parallel \
  --use-flash-attn \
  --transformer-impl local \
  --use-distributed-optimizer \
  --enable-zb-runtime \
  --no-create-attention-mask-in-dataloader \
  --profile-ranks $profile_ranks "

if [ -e "$DATASET"".idx" ]; then
  options="$options --data-path ${DATASET} --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model ${TOKENIZER}"
else
  echo "no dataset at ${DATASET} (DATASET_DIR; DOWNLOAD=1 fetches the fork's): training on mock data"
  options="$options --mock-data --vocab-size ${VOCAB_SIZE:-32000}"
fi

if [ -z "$FP32" ]; then
  options="$options --fp16"
fi

if [ ! -z "$ZERO_BUBBLE_V_SCHEDULE" ]; then
  ENABLE_ZERO_BUBBLE=1
  options="$options --zero-bubble-v-schedule "
fi

if [ ! -z "$ENABLE_ZERO_BUBBLE" ]; then
  options="$options --enable-zero-bubble \
  --zero-bubble-pipeline-timers-start-iter $ZERO_BUBBLE_TIMER_START \
  --zero-bubble-pipeline-timers-end-iter $ZERO_BUBBLE_TIMER_END \
  --zero-bubble-max-pending-backward $ZERO_BUBBLE_MEM_LIMIT"
  if [ -z "$FP32" ]; then
    if [ -z "$SYNC_OPTIMIZER" ]; then
        options="$options --enable-optimizer-post-validation"
    fi
  fi
fi

if [ ! -z "$ENABLE_EXACTLY_NUMERIC_MATCH" ]; then
  options="$options --enable-exactly-numeric-match \
  --attention-dropout 0.0 \
  --hidden-dropout 0.0"
fi

if [ ! -z "$INTERLEAVED_1F1B" ]; then
  options="$options --num-layers-per-virtual-pipeline-stage 1"
fi

run_cmd="torchrun --nnodes $WORLD_SIZE \
  --node_rank $RANK \
  --master_addr $MASTER_ADDR \
  --master_port $MASTER_PORT \
  --nproc_per_node=$GPUS_PER_NODE ${ROOT}/pretrain_llama.py $@ ${options} ${EXTRA_OPTIONS}"

echo $run_cmd
eval $run_cmd
