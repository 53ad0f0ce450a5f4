"""The data, checkpointing and logging flags, with Megatron-LM's names and defaults."""
from __future__ import annotations

import argparse

from llamapipe.data.tokenizer import TOKENIZER_TYPES


def add_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data", "One source: --mock-data, --data-path (split by --split), or per-split "
                             "--train-data-path / --valid-data-path / --test-data-path.")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="preprocessed dataset prefixes (without .bin/.idx), or weight prefix weight prefix ...")
    g.add_argument("--split", default=None,
                   help="train,valid,test weights over --data-path's documents, e.g. 99,1 (missing ones are 0); "
                        "None: 969,30,1")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"{split} dataset prefixes (or weight prefix ...), each used whole; no --split")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model, or an HF tokenizer.json or the directory holding it")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="kind of --tokenizer-model; None: guessed from it (a .model file is sentencepiece, a "
                        "tokenizer.json or a directory holding one is HuggingFaceTokenizer, e.g. LLaMA 3's); "
                        "NullTokenizer: data that is token ids already, with --vocab-size")
    g.add_argument("--mock-data", action="store_true", help="synthetic, learnable token sequences; no files")
    g.add_argument("--data-cache-path", default=None,
                   help="directory of the dataset index caches; None: a cache/ folder next to the data")
    g.add_argument("--num-workers", type=int, default=2, help="data-loader worker processes per rank")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart at 0 after each end-of-document token of a packed sample")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="a token attends only to the tokens of its own document in a packed sample (block-causal "
                        "mask; the document ends at its end-of-document token)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the end-of-document token (its label is the next "
                        "document's first token)")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--load", default=None, help="directory to resume from (its newest complete checkpoint)")
    g.add_argument("--overwrite-save", action="store_true",
                   help="a run that does not --load its --save directory deletes the checkpoints already there "
                        "first; without it such a run is refused, so two runs' checkpoints never mix")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model shape (layers, sizes, heads, groups, RoPE, seq length) from the --load "
                        "checkpoint: flags not given are filled, the architecture switches are overridden")
    g.add_argument("--no-load-optim", action="store_true", help="load the weights but not the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the random number generators")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only and start at iteration 0")
    g.add_argument("--keep-last-n", type=int, default=None,
                   help="after each verified save, delete older checkpoints beyond the newest N")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
                   help="on --load, take the learning-rate schedule (lr, min-lr, warmup, decay length and style) "
                        "from the command line, not from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
                   action="store_true",
                   help="on --load, take the learning-rate schedule from the checkpoint; with neither flag a "
                        "difference between the two is an error")
    g.add_argument("--async-save", action="store_true",
                   help="copy the state to CPU and write the checkpoint on a background thread while training "
                        "goes on; the tracker is updated once every rank's files are written and verified")
    g.add_argument("--ckpt-format", default="torch",
                   help="torch: llamapipe's checkpoints (safetensors shards, metadata.json) in --save; torch_dist: "
                        "also Megatron-LM's torch_dist format, --save's iter_* directories, which Megatron and "
                        "megatron-core load, with ours kept in --save/llamapipe/ (docs/megatron_checkpoints.md)")
    g.add_argument("--allow-tokenizer-change", action="store_true",
                   help="on --load, go on when the checkpoint was trained with another tokenizer (another file "
                        "or size) than --tokenizer-model; without it that is an error, as its token ids mean "
                        "other text")


def add_logging_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines")
    g.add_argument("--log-throughput", action="store_true", help="log the throughput (tokens/s and TFLOP/s)")
    g.add_argument("--log-params-norm", action="store_true", help="log the norm of all parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zero gradients")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="0: no timers; 1: each pipeline rank's compute, communication and idle time and the "
                        "measured bubble (idle share of the iteration) every --log-interval, plus forward-backward "
                        "and optimizer; 2: also Megatron's per-phase timers (forward-compute, backward-compute, the "
                        "recv timers, all-grads-sync, ...)")
    g.add_argument("--timing-log-option", default="minmax", choices=("max", "minmax", "all"),
                   help="how each timer is reported across ranks: the maximum, the minimum and maximum, or every "
                        "rank (Megatron's)")
    g.add_argument("--log-straggler", action="store_true",
                   help="every --log-interval, the slowest and fastest ranks by compute for their share of the plan "
                        "(message waits left out; different stages compared through the plan's expected costs) "
                        "and their ratio, in the log line, JSONL and TensorBoard; a rank whose compute exceeds its "
                        "data-parallel replicas' by --straggler-threshold three intervals in a row is named "
                        "(Megatron's; timers at level 1 at least)")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="with --log-straggler: how many of the slowest and of the fastest ranks the JSONL lists "
                        "(Megatron's)")
    g.add_argument("--straggler-threshold", type=float, default=1.1,
                   help="with --log-straggler: the ratio of a rank's compute to the fastest of its data-parallel "
                        "replicas that names it a straggler (three intervals in a row); at data-parallel size 1, 1.5 "
                        "times this over the stages' expected-cost ratio")
    g.add_argument("--pipeline-trace", default=None, metavar="PATH",
                   help="write one Chrome-trace JSON of the iterations --profile-step-start/-end name, merged over "
                        "all ranks on one clock (each action, message waits, arrows from sends to receives); open "
                        "it in Perfetto or chrome://tracing, or draw it beside its plan with llamapipe plot-trace")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="with --pipeline-trace: trace from when this many iterations have completed (Megatron's)")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="with --pipeline-trace: stop when this many iterations have completed")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=None,
                   help="with --pipeline-trace: the global ranks that record (default: all; Megatron's is 0)")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events here")
    g.add_argument("--metrics-jsonl", default=None, help="write one JSON line of metrics per logged iteration")
    g.add_argument("--wandb-project", default=None, help="log to this Weights & Biases project (pip extra wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="Weights & Biases run name")
    g.add_argument("--wandb-save-dir", default=None, help="directory for the Weights & Biases run files")
