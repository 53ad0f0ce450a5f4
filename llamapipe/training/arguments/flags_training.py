"""The training-length, batch, learning-rate and precision flags, with Megatron-LM's names and defaults.

Training runs for --train-iters iterations or --train-samples samples (exclusive, as in Megatron); the
learning-rate schedule is given in the same unit (--lr-warmup/decay-iters or -samples) or as a fraction.
"""
from __future__ import annotations

import argparse
import signal

from llamapipe.training.signals import EXIT_SIGNALS


def _exit_signal(text: str) -> signal.Signals:
    """--exit-signal's value: a signal name as Megatron takes it (SIGTERM), also without SIG or in lower case."""
    name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
    if name not in {sig.name for sig in EXIT_SIGNALS}:
        raise argparse.ArgumentTypeError(f"{text} is not a signal a run can save on; use one of "
                                         f"{', '.join(sig.name for sig in EXIT_SIGNALS)}")
    return signal.Signals[name]


def add_training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1,
                   help="samples per microbatch (Megatron requires it; 1 here when not given)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration; None: micro-batch-size x data-parallel size")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "RAMP_SAMPLES"),
                   help="grow the global batch from START by INCREMENT over RAMP_SAMPLES samples "
                        "(with --train-samples)")
    g.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sample; None: 128 with a --model preset (Megatron requires it)")
    g.add_argument("--train-iters", type=int, default=None,
                   help="iterations to train; None: from --train-samples, else 10")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train (instead of --train-iters); iterations = samples / global batch")
    g.add_argument("--seed", type=int, default=1234, help="seed of the initial weights and the data order")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between evaluations on the validation set; None: only after training")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="iterations per evaluation (validation and test); 0 or -1: no evaluation")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all tokens of the global batch instead of per microbatch")
    g.add_argument("--exit-interval", type=int, default=None, help="stop after an iteration divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="stop after this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal or Ctrl-C (SIGINT), save a checkpoint and exit at the end of the iteration "
                        "(without it those signals stop the run at once, saving nothing)")
    g.add_argument("--exit-signal", type=_exit_signal, default=signal.SIGTERM, metavar="SIGNAL",
                   help="the signal --exit-signal-handler saves on (Megatron's): SIGTERM, SIGUSR1 (SLURM's "
                        "--signal=USR1@120), SIGUSR2, SIGINT, SIGHUP, SIGQUIT or SIGXCPU")
    g.add_argument("--skip-nonfinite-steps", action="store_true",
                   help="skip an optimizer step whose gradients are not finite instead of stopping")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collection; collect only at chosen points")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: iterations between collections (0: none during training)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval",
                   action="store_false", help="with --manual-gc: do not collect around evaluation")
    g.add_argument("--pipeline-profile-iters", type=int, default=3,
                   help="auto and zb-h2 schedules: 1F1B iterations profiled before switching")
    g.add_argument("--pipeline-profile", default=None, metavar="PROFILE.json",
                   help="with --pipeline-model-parallel-layout auto: split the layers by the costs this "
                        "`llamapipe profile` measured (without it: by the analytic FLOP model)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer and the final norm (inductor); works under every schedule")
    g.add_argument("--release-host-memory", action="store_true",
                   help="CPU runs: let malloc return freed memory to the OS (glibc's default) instead of "
                        "keeping it for the next step")


def add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and precision")
    g.add_argument("--optimizer", choices=("adam",), default="adam", help="AdamW (decoupled weight decay)")
    g.add_argument("--lr", type=float, default=3e-4,
                   help="peak learning rate (Megatron has no usable default)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and the output layer, on --lr's warmup and decay "
                        "(Megatron's); None: --lr")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="the embedding's and output layer's rate at the end of the decay, with --decoupled-lr; "
                        "None: --min-lr")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear",
                   help="shape of the decay from --lr to --min-lr")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup from 0")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="samples of linear warmup from 0 (with --train-samples)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay length (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay length; None: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay length in samples (with --train-samples); None: --train-samples")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on norms)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's denominator epsilon")
    g.add_argument("--enable-optimizer-post-validation", action="store_true",
                   help="each pipeline stage steps as soon as its gradients are final and validates the global "
                        "grad norm and inf/NaN check afterwards (rolling back when they would have changed "
                        "the step), so iterations overlap; results stay identical; it pauses while steps clip or "
                        "overflow, where rolling back would cost a re-run iteration each")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this; 0: off")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and compute, fp32 master weights")
    g.add_argument("--fp16", action="store_true", help="fp16 parameters and compute with loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="fixed fp16 loss scale; None: dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="first dynamic fp16 loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="smallest dynamic fp16 loss scale")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="finite steps before the dynamic loss scale grows")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the loss scale shrinks")
