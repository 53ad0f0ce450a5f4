"""The command line is frozen (torchtitan's idea): adding or removing a flag is a deliberate change
here, and every flag is documented in docs/ (docs/flags.md is generated from the parser) and in --help,
with its default. Megatron-LM's flags that have no effect here or are refused live in two tables
(training/arguments/megatron_compat.py) and are pinned by those tables."""
import argparse
import os

from llamapipe.training.arguments.megatron_compat import NOTICES, REFUSED
from llamapipe.training.arguments.parser import build_parser
from llamapipe.training.arguments.zb_fork_flags import FLAGS as FORK_FLAGS

from tests.harness import ROOT

FLAGS = """
--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
--adam-beta1 --adam-beta2 --add-qkv-bias --adam-eps --attention-dropout --bf16 --calculate-per-token-loss --clip-grad --compile
--context-parallel-size --cp-comm-type --hierarchical-context-parallel-sizes
--enable-optimizer-post-validation --enable-vocab-parallel
--data-cache-path --data-parallel-sharding-strategy --data-path
--ddp-bucket-size
--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers
--disable-bias-linear --distributed-backend --distributed-timeout-minutes --eval-interval --eval-iters
--exit-duration-in-mins --exit-interval --exit-signal-handler --exit-signal --ffn-hidden-size --finetune --fp16
--global-batch-size --group-query-attention --hang-report-keep-waiting --hang-report-seconds --hidden-dropout --hidden-size --hysteresis --init-method-std
--initial-loss-scale --keep-last-n --load --override-opt_param-scheduler --use-checkpoint-opt_param-scheduler --use-torch-fsdp2 --async-save --log-interval --loss-scale --loss-scale-window --lr --lr-decay-iters
--lr-decay-style --lr-warmup-iters --make-vocab-size-divisible-by --max-position-embeddings --metrics-jsonl
--micro-batch-size --min-loss-scale --min-lr --mock-data --model --no-load-optim --no-load-rng --norm-epsilon
--normalization --num-attention-heads --num-layers --num-layers-per-virtual-pipeline-stage --num-query-groups
--num-seq-splits --num-virtual-stages-per-pipeline-rank --num-workers --optimizer --optimizer-cpu-offload --overlap-grad-reduce --parallel-order --pipeline-memory-limit
--pipeline-model-parallel-layout --pipeline-model-parallel-size --pipeline-profile-iters --pipeline-schedule --pipeline-trace --position-embedding-type --profile-ranks --profile-step-end --profile-step-start
--recompute-granularity --recompute-method --recompute-num-layers --release-host-memory --rotary-base --save --save-interval --seed
--seq-length --seq1f1b-balance-method --sequence-parallel --skip-nonfinite-steps --split --swiglu --tensor-model-parallel-size
--tensorboard-dir --tie-embeddings-and-output-weights --timing-log-level --timing-log-option --tokenizer-model --tokenizer-type --train-iters
--untie-embeddings-and-output-weights --use-distributed-optimizer --use-rotary-position-embeddings
--vocab-size --weight-decay
--kv-channels --rotary-percent --train-samples --lr-warmup-samples --lr-decay-samples --lr-warmup-fraction
--rampup-batch-size --manual-gc --manual-gc-interval --no-manual-gc-eval --train-data-path --valid-data-path
--test-data-path --log-throughput --log-params-norm --log-num-zeros-in-grad --wandb-project --wandb-exp-name
--wandb-save-dir --use-checkpoint-args --recompute-activations --use-flash-attn
--pipeline-schedule-file --pipeline-profile --allow-tokenizer-change --dry-run --overwrite-save --ckpt-format
--reset-position-ids --reset-attention-mask --eod-mask-loss
--use-rope-scaling --rope-scaling-factor
--decoupled-lr --decoupled-min-lr
--cpu-offload --offload-chunk-num --offload-time --auto-offload-time --offload-overlap-sr --offload-weight-grad-inputs
--fine-grained-activation-offloading --offload-modules --activation-offload-fraction --min-offloaded-tensor-size
--delta-offload-bytes-across-pp-ranks --use-tp-pp-dp-mapping --microbatch-group-size-per-virtual-pipeline-stage
--recompute-modules --recompute-lgd
--log-straggler --straggler-minmax-count --straggler-threshold
""".split()
COMPAT = [entry.flag for entry in NOTICES + REFUSED] + list(FORK_FLAGS)   # the zero-bubble fork's, pinned there


def parser_flags():
    return sorted(a.option_strings[0] for a in build_parser()._actions
                  if a.option_strings and a.option_strings[0] != "-h")


def test_cli_flag_set_is_pinned():
    assert not set(FLAGS) & set(COMPAT), "a flag is both implemented and in a compatibility table"
    assert len(set(COMPAT)) == len(COMPAT)
    assert parser_flags() == sorted(FLAGS + COMPAT)


def test_every_flag_has_a_help_line_and_help_shows_defaults():
    parser = build_parser()
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not (a.help or "").strip()]
    assert not missing, f"flags without help: {missing}"
    text = parser.format_help()

    def entry(option: str) -> str:       # the option's own lines of --help, after the usage
        return " ".join(text.split("\n  " + option)[1].split("\n  -")[0].split())
    assert entry("--adam-beta2 ADAM_BETA2").endswith("(default: 0.999)")
    assert entry("--eval-iters EVAL_ITERS").endswith("(default: 100)")
    assert entry("--use-mcore-models").startswith("no effect: ")
    assert entry("--expert-model-parallel-size EXPERT_MODEL_PARALLEL_SIZE").startswith("refused unless 1 (off): ")
    assert entry("--context-parallel-size CONTEXT_PARALLEL_SIZE").endswith("(default: 1)")


def test_abbreviated_flags_are_refused():
    """Megatron's parser has allow_abbrev=False: --train-iter is not --train-iters."""
    parser = build_parser()
    assert parser.allow_abbrev is False
    try:
        parser.parse_args(["--train-iter", "5"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("--train-iter was accepted as an abbreviation")
    assert isinstance(parser.parse_args(["--train-iters", "5"]), argparse.Namespace)


def test_every_flag_is_documented_in_docs():
    docs = "".join(open(os.path.join(ROOT, "docs", name)).read() for name in os.listdir(os.path.join(ROOT, "docs"))
                   if name.endswith(".md"))
    missing = [flag for flag in parser_flags() if f"`{flag}" not in docs]
    assert not missing, f"flags missing from docs/*.md: {missing}"
