#!/bin/bash
# The zero-bubble fork's examples/pretrain_zero_bubble.sh (sail-sg/zero-bubble-pipeline-parallelism, 39f2c18),
# run through llamapipe's pretrain_llama.py: the same options, the same environment switches
# (ZERO_BUBBLE_V_SCHEDULE, ENABLE_ZERO_BUBBLE, FP32, SYNC_OPTIMIZER, EXTRA_OPTIONS, ...), the same defaults.
# What differs: it runs without GPUs (GPUS_PER_NODE defaults to 2 when nvidia-smi finds none), the dataset
# and tokenizer directory (DATASET_DIR) and the sizes the fork hard-codes (SEQ_LENGTH, MAX_POSITION_EMBEDDINGS,
# EVAL_ITERS, TRAIN_SAMPLES) can be set from the environment, and there is no nsys branch (PROFILED).
# The fork's quick settings, e.g.:
#   ZERO_BUBBLE_V_SCHEDULE=1 examples/zero_bubble/pretrain_zero_bubble.sh                  (ZB-V)
#   ZERO_BUBBLE_V_SCHEDULE=1 SYNC_OPTIMIZER=1 EXTRA_OPTIONS="--zero-bubble-v-schedule-mem-setup half" ...  (V-Half)
#   ENABLE_ZERO_BUBBLE=1 ZERO_BUBBLE_MEM_LIMIT=$((2 * PIPELINE_SIZE)) ...                 (ZB-2p)
# tests/e2e/test_zero_bubble_fork_script.py runs it scaled down on CPU.

DIR=`pwd`
mkdir -p $DIR/logs

DATASET_DIR=${DATASET_DIR:-'/tmp/zb_sample_dataset'}
DATASET="${DATASET_DIR}/dataset/c4_text_document"
TOKENIZER="${DATASET_DIR}/tokenizers/tokenizer.model"

if [ ! -e "$DATASET"".idx" ]; then
  wget https://huggingface.co/datasets/ufotalent/zero_bubble_sample_dataset/resolve/main/zb_sample_dataset.tar.gz
  tar -xvf zb_sample_dataset.tar.gz -C /tmp
fi

# Running locally
if [ -z "$WORLD_SIZE" ]; then
  export WORLD_SIZE=1
  export RANK=0
  export MASTER_ADDR=localhost
  export MASTER_PORT=10086
fi

if [ -z "$GPUS_PER_NODE" ]; then
  GPUS_PER_NODE=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  if [ "$GPUS_PER_NODE" -eq 0 ]; then
    GPUS_PER_NODE=2
  fi
fi

if [ -z "$EXIT_INTERVAL" ]; then
  EXIT_INTERVAL=1000
fi

if [ -z "$LOG_INTERVAL" ]; then
  LOG_INTERVAL=10
fi

WORLD_SIZE_IN_GPUS=$(( $WORLD_SIZE * $GPUS_PER_NODE ))

if [ -z "$PIPELINE_SIZE" ]; then
  PIPELINE_SIZE=2
  LAYERS=8
  MICRO_BATCH_SIZE=1
  GLOBAL_BATCH_SIZE=8
  HIDDEN_SIZE=8192
  ATTENTION_HEADS=64
  ZERO_BUBBLE_MEM_LIMIT=$((2 * $PIPELINE_SIZE))
fi

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
  --lr-decay-samples 126953125 \
  --lr-warmup-samples 183105 \
  --lr 6.0e-5 \
  --min-lr 6.0e-6 \
  --lr-decay-style cosine \
  --log-interval ${LOG_INTERVAL} \
  --eval-iters ${EVAL_ITERS:-40} \
  --eval-interval $EVAL_INTERVAL \
  --data-path ${DATASET} \
  --tokenizer-type GPTSentencePieceTokenizer \
  --tokenizer-model ${TOKENIZER} \
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
  --nproc_per_node=$GPUS_PER_NODE ${DIR}/pretrain_llama.py $@ ${options} ${EXTRA_OPTIONS}"

echo $run_cmd
eval $run_cmd
