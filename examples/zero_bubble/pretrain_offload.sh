#!/bin/bash
# The zero-bubble fork's examples/pretrain_offload.sh (sail-sg/zero-bubble-pipeline-parallelism, 39f2c18: PipeOffload,
# arXiv 2503.01328), run through llamapipe's pretrain_llama.py: the same options and environment switches
# (INTERLEAVED_1F1B, INTERLEAVE_GROUP, OFFLOAD, OFFLOAD_TIME, OFFLOAD_CHUNK_NUM, NO_BARRIER, FP32,
# ENABLE_ZERO_BUBBLE, ZERO_BUBBLE_V_SCHEDULE, DISTRIBUTED_OPTIMIZER, EXTRA_OPTIONS, ...), the fork's defaults on GPUs.
# What differs, as in pretrain_zero_bubble.sh beside it:
# - without GPUs (nvidia-smi finds none) it runs 2 CPU processes with CPU-sized defaults: pp 2, 4 layers of hidden
#   64 (4 heads, 2 query groups), seq 128, global batch 4, 80 samples, fp32 (FP32=1), 2 evaluation iterations;
# - every size the fork hard-codes can be set from the environment (SEQ_LENGTH, GQA, TRAIN_SAMPLES,
#   LR_DECAY_SAMPLES, LR_WARMUP_SAMPLES, VOCAB_SIZE, EVAL_ITERS);
# - the data: the fork's sample dataset when DATASET_DIR holds it, else mock data; it installs and downloads
#   nothing (the fork's script runs pip install and wget) and has no nsys branch (PROFILED).
# The fork's README quick start for offload, from the repository root:
#   OFFLOAD=1 INTERLEAVED_1F1B=1 INTERLEAVE_GROUP=2 OFFLOAD_CHUNK_NUM=1 examples/zero_bubble/pretrain_offload.sh
# tests/e2e/test_zero_bubble_fork_script.py runs it with test_all_schedules.sh's offload-grouped-interleaved
# settings, scaled down.

DIR=`pwd`
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p $DIR/logs

DATASET_DIR=${DATASET_DIR:-'/tmp/zb_sample_dataset'}
DATASET="${DATASET_DIR}/dataset/c4_text_document"
TOKENIZER="${DATASET_DIR}/tokenizers/tokenizer.model"

if [ -z "$WORLD_SIZE" ]; then
  export WORLD_SIZE=1
  export RANK=0
  export MASTER_ADDR=localhost
  export MASTER_PORT=${MASTER_PORT:-10088}
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
  TRAIN_SAMPLES=${TRAIN_SAMPLES:-80}
  LR_DECAY_SAMPLES=${LR_DECAY_SAMPLES:-80}
  LR_WARMUP_SAMPLES=${LR_WARMUP_SAMPLES:-8}
  EVAL_ITERS=${EVAL_ITERS:-2}
  LOG_INTERVAL=${LOG_INTERVAL:-5}
  VOCAB_SIZE=${VOCAB_SIZE:-1024}
  ZERO_BUBBLE_TIMER_START=${ZERO_BUBBLE_TIMER_START:-2}
  ZERO_BUBBLE_TIMER_END=${ZERO_BUBBLE_TIMER_END:-4}
fi

if [ -z "$EXIT_INTERVAL" ]; then
  EXIT_INTERVAL=20
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
  FFN_HIDDEN_SIZE=256
  ATTENTION_HEADS=4
  GQA=${GQA:-2}
  ZERO_BUBBLE_MEM_LIMIT=$((2 * $PIPELINE_SIZE))
elif [ -z "$PIPELINE_SIZE" ]; then
  PIPELINE_SIZE=$(( $WORLD_SIZE_IN_GPUS ))
  LAYERS=$(( $PIPELINE_SIZE * 3 - 2))
  MICRO_BATCH_SIZE=1
  GLOBAL_BATCH_SIZE=$(( $PIPELINE_SIZE * 2 * $MICRO_BATCH_SIZE ))
  HIDDEN_SIZE=4096
  FFN_HIDDEN_SIZE=16384
  ATTENTION_HEADS=32
  ZERO_BUBBLE_MEM_LIMIT=$((2 * $PIPELINE_SIZE))
  GQA=8
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
TP_SIZE=1
fi

if [ -z "$SEQ_LENGTH" ]; then
  SEQ_LENGTH=8192
fi

if [ -z "$FFN_HIDDEN_SIZE" ]; then
  FFN_HIDDEN_SIZE=$(( $HIDDEN_SIZE * 4 ))
fi

TRAIN_SAMPLES=${TRAIN_SAMPLES:-$(( 146484375 * 1024 / $SEQ_LENGTH ))}
LR_DECAY_SAMPLES=${LR_DECAY_SAMPLES:-$(( 126953125 * 1024 / $SEQ_LENGTH ))}
options=" \
  --tensor-model-parallel-size $TP_SIZE \
  --pipeline-model-parallel-size $PIPELINE_SIZE \
  --num-layers $LAYERS \
  --hidden-size $HIDDEN_SIZE \
  --ffn-hidden-size $FFN_HIDDEN_SIZE \
  --num-attention-heads $ATTENTION_HEADS \
  --group-query-attention \
  --num-query-groups $GQA \
  --exit-interval $EXIT_INTERVAL \
  --seq-length $SEQ_LENGTH \
  --max-position-embeddings $SEQ_LENGTH \
  --micro-batch-size $MICRO_BATCH_SIZE \
  --global-batch-size $GLOBAL_BATCH_SIZE \
  --train-samples $TRAIN_SAMPLES \
  --lr-decay-samples $LR_DECAY_SAMPLES \
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
  --profile-step-start 3 \
  --profile-step-end 6 \
  --transformer-impl local \
  --use-legacy-models \
  --use-flash-attn \
  --no-bias-dropout-fusion \
  --no-create-attention-mask-in-dataloader \
  --untie-embeddings-and-output-weights \
  --allow-padding-num-layers \
  --initial-loss-scale 65536 \
  --sequence-parallel \
  --recompute-lgd \
  --measure-activation-memory \
  --use-tp-pp-dp-mapping \
  --offload-continuous-buffers \
  --profile-ranks $profile_ranks"

if [ -e "$DATASET"".idx" ]; then
  options="$options --data-path ${DATASET} --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model ${TOKENIZER}"
else
  echo "no dataset at ${DATASET} (DATASET_DIR): training on mock data"
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
  if [ ! -z "$INTERLEAVE_GROUP" ]; then
    options="$options --interleave-group-size $INTERLEAVE_GROUP --enable-zb-runtime"
    if [ ! -z "$OFFLOAD" ]; then
      if [ ! -z "$OFFLOAD_TIME" ]; then
        options="$options --offload-time $OFFLOAD_TIME --offload-chunk-num $OFFLOAD_CHUNK_NUM"
      else
        options="$options --auto-offload-time --offload-chunk-num $OFFLOAD_CHUNK_NUM"
      fi
    fi
  else
    options="$options --no-pre-communication-optimization"
  fi
else
  options="$options --no-pre-communication-optimization"
fi

if [ ! -z "$OFFLOAD" ]; then
  options="$options --cpu-offload "
  if [ ! -z "$NO_BARRIER" ]; then
    options="$options --no-paired-barrier "
  fi
fi

if [ ! -z "$DISTRIBUTED_OPTIMIZER" ]; then
  options="$options --use-distributed-optimizer"
fi

run_cmd="torchrun --nnodes $WORLD_SIZE \
  --node_rank $RANK \
  --master_addr $MASTER_ADDR \
  --master_port $MASTER_PORT \
  --nproc_per_node=$GPUS_PER_NODE ${ROOT}/pretrain_llama.py $@ ${options} ${EXTRA_OPTIONS}"

echo $run_cmd
eval $run_cmd
