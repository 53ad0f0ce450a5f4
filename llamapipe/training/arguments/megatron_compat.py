"""Megatron-LM flags llamapipe accepts without acting on them, and those it refuses: two tables.

Megatron's LLaMA and GPT example scripts (examples/llama/*.sh, examples/gpt3/*.sh) pass switches for
Megatron's own kernels, checkpoint formats and tools. So that those scripts run unchanged, every flag here
is parsed with Megatron's arity. One that has no effect here gets one notice line at start-up (rank 0); one
whose meaning llamapipe lacks stops the run with one line saying why and what to use instead, unless its
value is the one that means "off" in Megatron (e.g. --expert-model-parallel-size 1).
"""
from __future__ import annotations

import argparse

from llamapipe.core.config import ArgumentError
from llamapipe.training.arguments.compat_table import CompatFlag, add_table, dest_of, said
from llamapipe.training.arguments.schedule_file_args import (add_schedule_file_flag, check_schedule_file,
                                                         schedule_file_lines)
from llamapipe.training.arguments.offload_args import add_offload_flags
from llamapipe.training.arguments.zb_fork_flags import add_fork_flags, check_fork_flags

_FUSION = "a switch of Megatron's fused CUDA kernels; llamapipe has none (torch picks its kernels)"
_TB = "TensorBoard gets the loss, learning rate, grad norm and loss scale only"
_PROFILE = "no built-in profiler; wrap the run in torch.profiler or nsys"
_DYNAMIC_CP = ("dynamic context parallelism (a CP size per packed sequence) is not implemented; every sequence "
               "is split over --context-parallel-size ranks")
_FP8 = "FP8 training needs Transformer Engine, which llamapipe does not use; train with --bf16"

NOTICES: tuple[CompatFlag, ...] = (
    CompatFlag("--use-mcore-models", "llamapipe has one LLaMA implementation, laid out like Megatron core's"),
    CompatFlag("--use-legacy-models", "llamapipe has one LLaMA implementation, not Megatron's legacy model"),
    CompatFlag("--transformer-impl", "layers are llamapipe's own PyTorch modules (no Transformer Engine)", str),
    CompatFlag("--attention-backend", "attention is torch's scaled_dot_product_attention, which picks its kernel "
               "(--use-flash-attn forces FlashAttention on CUDA)", str),
    CompatFlag("--apply-layernorm-1p", "RMSNorm stores its scale itself; storing scale - 1 is the same model"),
    CompatFlag("--attention-softmax-in-fp32", "torch's attention kernels keep the softmax in fp32"),
    CompatFlag("--no-masked-softmax-fusion", _FUSION),
    CompatFlag("--no-bias-gelu-fusion", _FUSION),
    CompatFlag("--no-bias-swiglu-fusion", _FUSION),
    CompatFlag("--no-bias-dropout-fusion", _FUSION),
    CompatFlag("--no-rope-fusion", _FUSION),
    CompatFlag("--no-persist-layer-norm", _FUSION),
    CompatFlag("--no-gradient-accumulation-fusion", _FUSION),
    CompatFlag("--cross-entropy-loss-fusion", "the cross entropy is llamapipe's vocabulary-parallel one, in place "
               "on the logits"),
    CompatFlag("--cross-entropy-fusion-impl", "the cross entropy is llamapipe's vocabulary-parallel one", str),
    CompatFlag("--tp-comm-overlap", "Transformer Engine's tensor-parallel GEMM/communication overlap is not used"),
    CompatFlag("--overlap-param-gather", "the distributed optimizer gathers the parameters right after its step"),
    CompatFlag("--overlap-param-gather-with-optimizer-step",
               "the distributed optimizer gathers the parameters right after its step"),
    CompatFlag("--grad-reduce-in-bf16", "half-precision gradients are reduced in fp32"),
    CompatFlag("--accumulate-allreduce-grads-in-fp32", "half-precision gradients are always reduced in fp32"),
    CompatFlag("--ckpt-fully-parallel-load", "checkpoint loading has one strategy: each rank reads what it holds"),
    CompatFlag("--async-strategy", "--async-save has one strategy here: a background writer thread per rank", str),
    CompatFlag("--empty-unused-memory-level", "the CUDA caching allocator is not emptied between steps", int),
    CompatFlag("--profile", _PROFILE),
    CompatFlag("--use-pytorch-profiler", _PROFILE),
    CompatFlag("--log-timers-to-tensorboard", _TB),
    CompatFlag("--log-memory-to-tensorboard", _TB),
    CompatFlag("--log-world-size-to-tensorboard", _TB),
    CompatFlag("--log-validation-ppl-to-tensorboard", "the validation loss is logged; its perplexity is exp(loss)"),
    CompatFlag("--tensorboard-queue-size", "events are written as they come", int),
    CompatFlag("--tensorboard-log-interval", "TensorBoard is written every --log-interval", int),
    CompatFlag("--wandb-entity", "it is not passed to wandb; set WANDB_ENTITY instead", str),
    CompatFlag("--no-create-attention-mask-in-dataloader", "no (s, s) attention mask is ever built: attention is "
               "causal, and causal within documents under --reset-attention-mask, from per-token document ids"),
    CompatFlag("--no-mmap-bin-files", ".bin files are always memory-mapped"),
    CompatFlag("--no-check-for-nan-in-loss-and-grad", "a step whose gradients are not finite stops the run, as "
               "Megatron's check does, unless --skip-nonfinite-steps skips it"),
    CompatFlag("--num-dataset-builder-threads", "rank 0 builds the dataset indices in one thread", int),
    CompatFlag("--max-seqlen-per-dp-cp-rank", "sequences are not packed (dynamic context parallelism); each "
               "rank holds --seq-length / --context-parallel-size tokens of every sequence", int),
    CompatFlag("--disable-straggler-on-startup", "there is no controller port to switch the detector on later: "
               "--log-straggler reports from the first interval"),
    CompatFlag("--straggler-ctrlr-port", "there is no controller port to switch the detector on or off: "
               "--log-straggler reports every --log-interval", int),
    CompatFlag("--tiktoken-pattern", "it is for Megatron's TikTokenizer; a tokenizer.json carries its own "
               "pre-tokenizer pattern", str),
)

REFUSED: tuple[CompatFlag, ...] = (
    CompatFlag("--rope-theta", "it is HF's config.json name for RoPE's base; the flag is --rotary-base "
               "(Megatron's)", float),
    CompatFlag("--dynamic-context-parallel", _DYNAMIC_CP),
    CompatFlag("--hybrid-context-parallel", _DYNAMIC_CP),
    CompatFlag("--min-dynamic-context-parallel-size", _DYNAMIC_CP, int),
    CompatFlag("--expert-model-parallel-size", "LLaMA is a dense model and mixture-of-experts is not implemented",
               int, off=(1,)),
    CompatFlag("--num-experts", "LLaMA is a dense model and mixture-of-experts is not implemented; drop it",
               int, off=(0,)),
    CompatFlag("--fp8-format", _FP8, str),
    CompatFlag("--fp8-recipe", _FP8, str),
    CompatFlag("--fp8-hybrid", _FP8),
    CompatFlag("--fp8-amax-history-len", _FP8, int),
    CompatFlag("--fp8-amax-compute-algo", _FP8, str),
    CompatFlag("--fp8-param-gather", _FP8),
    CompatFlag("--first-last-layers-bf16", _FP8),
    CompatFlag("--num-layers-at-start-in-bf16", _FP8, int),
    CompatFlag("--num-layers-at-end-in-bf16", _FP8, int),
    CompatFlag("--vocab-file", "GPT-2 BPE vocab/merges files are not read; save the tokenizer as a tokenizer.json "
               "and pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model", str),
    CompatFlag("--merge-file", "GPT-2 BPE vocab/merges files are not read; save the tokenizer as a tokenizer.json "
               "and pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model", str),
    CompatFlag("--step-batch-size-schedule", "use --rampup-batch-size START INCREMENT RAMP_SAMPLES", str),
)


def add_compat_flags(p: argparse.ArgumentParser) -> None:
    """Both tables as flags of two groups, each with its reason as help, the zero-bubble fork's flags
    (zb_fork_flags) in a third, and torchtitan's schedule file (schedule_file_args)."""
    add_table(p.add_argument_group("Megatron-LM flags with no effect here (one notice line each)"), NOTICES,
              "no effect: ")
    add_table(p.add_argument_group("Megatron-LM flags refused (the run stops with the reason)"), REFUSED, "refused: ")
    add_fork_flags(p)
    add_offload_flags(p)
    add_schedule_file_flag(p)


def check_compat(args: argparse.Namespace) -> list[str]:
    """Raise ArgumentError naming every refused flag given, in one line (so a script learns all it must drop
    at once); return one notice line per no-effect flag given, then the zero-bubble fork's
    (zb_fork_flags.check_fork_flags) and the line on a schedule file."""
    refused = [(said(e, value), e.why) for e in REFUSED
               for value in [getattr(args, dest_of(e.flag))] if value not in (None, False) and value not in e.off]
    if len(refused) == 1:
        raise ArgumentError(f"{refused[0][0]} is not supported: {refused[0][1]}")
    if refused:
        raise ArgumentError(f"{len(refused)} flags are not supported: " +
                            ", ".join(f"{flag} ({why})" for flag, why in refused))
    notices = [f"notice: {said(e, getattr(args, dest_of(e.flag)))} has no effect here: {e.why}"
               for e in NOTICES if getattr(args, dest_of(e.flag)) not in (None, False)]
    check_schedule_file(args)
    return notices + check_fork_flags(args) + schedule_file_lines(args)
