"""The command line is frozen (torchtitan's idea): adding or removing a flag is a deliberate change
here, and every flag is documented in docs/ (docs/flags.md is generated from the parser)."""
import os

from llamapipe.training.arguments.parser import build_parser

from tests.harness import ROOT

FLAGS = """
--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
--adam-beta1 --adam-beta2 --adam-eps --attention-dropout --bf16 --clip-grad --data-cache-path --data-path
--ddp-bucket-size
--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers
--disable-bias-linear --distributed-backend --distributed-timeout-minutes --eval-interval --eval-iters
--exit-duration-in-mins --exit-interval --exit-signal-handler --ffn-hidden-size --finetune --fp16
--global-batch-size --group-query-attention --hidden-dropout --hidden-size --hysteresis --init-method-std
--initial-loss-scale --keep-last-n --load --log-interval --loss-scale --loss-scale-window --lr --lr-decay-iters
--lr-decay-style --lr-warmup-iters --make-vocab-size-divisible-by --max-position-embeddings --metrics-jsonl
--micro-batch-size --min-loss-scale --min-lr --mock-data --model --no-load-optim --no-load-rng --norm-epsilon
--normalization --num-attention-heads --num-layers --num-layers-per-virtual-pipeline-stage --num-query-groups
--num-virtual-stages-per-pipeline-rank --num-workers --optimizer --overlap-grad-reduce --parallel-order --pipeline-memory-limit
--pipeline-model-parallel-size --pipeline-profile-iters --pipeline-schedule --position-embedding-type
--recompute-granularity --recompute-method --recompute-num-layers --release-host-memory --rotary-base --save --save-interval --seed
--seq-length --sequence-parallel --skip-nonfinite-steps --split --swiglu --tensor-model-parallel-size
--tensorboard-dir --tie-embeddings-and-output-weights --tokenizer-model --tokenizer-type --train-iters
--untie-embeddings-and-output-weights --use-distributed-optimizer --use-rotary-position-embeddings
--vocab-size --weight-decay
""".split()


def parser_flags():
    return sorted(a.option_strings[0] for a in build_parser()._actions
                  if a.option_strings and a.option_strings[0] != "-h")


def test_cli_flag_set_is_pinned():
    assert parser_flags() == sorted(FLAGS)


def test_every_flag_is_documented_in_docs():
    docs = "".join(open(os.path.join(ROOT, "docs", name)).read() for name in os.listdir(os.path.join(ROOT, "docs"))
                   if name.endswith(".md"))
    missing = [flag for flag in parser_flags() if f"`{flag}" not in docs]
    assert not missing, f"flags missing from docs/*.md: {missing}"
