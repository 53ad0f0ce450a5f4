"""The parallelism and model flags, with Megatron-LM's names, meanings and defaults.

A default of None means "not given": the value then comes from a --model preset or from Megatron's rule
(llamapipe.training.arguments.model_args), and the help says what that is.
"""
from __future__ import annotations

import argparse

from llamapipe.core.config import SHARDING_STRATEGIES
from llamapipe.core.pipeline_parallel.schedule_specs import SCHEDULES
from llamapipe.training.arguments.memory_limit import memory_limit
from llamapipe.model.families import PRESETS


class _Given(argparse.Action):
    """Stores the value and that it was given (`<dest>_given`): the default and the same value typed differ
    (--use-torch-fsdp2 with --data-parallel-sharding-strategy no_shard typed is a contradiction)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)

def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks per model")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages (ranks) per model")
    _add_context_parallel_flags(g)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk; several chunks per pipeline rank give the interleaved schedule")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline rank (newer Megatron's alternative to "
                        "--num-layers-per-virtual-pipeline-stage)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (uneven split; the rest split evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage, e.g. fewer to balance the LM head and loss")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="Megatron's layout string: E embedding, t decoder layer, L loss, | between virtual stages, "
                        "*N repeats, e.g. \"Et*3|(tt|)*2,tL\"; sets the layers of every virtual stage and the chunks "
                        "per rank (stages / --pipeline-model-parallel-size); auto: the split that balances the "
                        "pipeline ranks' work (by --pipeline-profile's measured costs, else FLOPs)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting layers over (virtual) stages")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the LM head and loss as one layer when splitting layers over (virtual) stages")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms and activations along the sequence over the tensor-parallel ranks")
    g.add_argument("--enable-vocab-parallel", action="store_true",
                   help="split the output layer and its loss by vocabulary over the pipeline ranks (arXiv "
                        "2411.05288; the zero-bubble authors' flag): every rank runs its shard as S/T actions")
    g.add_argument("--pipeline-schedule", default=None,
                   help=f"one of {', '.join(SCHEDULES)}; None: 1f1b, or interleaved with virtual stages")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved: microbatches run through each model chunk in groups of this many (Megatron's "
                        "schedule table); None: the pipeline size, the plain interleaved order")
    g.add_argument("--num-seq-splits", type=int, default=1,
                   help="Seq1F1B (arXiv 2406.03488; the zero-bubble fork's flag): split every microbatch along the "
                        "sequence into this many pieces that pipeline as units of the schedule (1f1b, zb-h1, zbv, "
                        "interleaved); later pieces attend to the earlier pieces' cached keys and values")
    g.add_argument("--seq1f1b-balance-method", choices=("flops", "length"), default="flops",
                   help="with --num-seq-splits: pieces of equal attention + MLP FLOPs (the paper's; later pieces "
                        "are shorter, every unit of the schedule costs the same) or of equal length")
    g.add_argument("--pipeline-memory-limit", type=memory_limit, default=None,
                   help="auto schedule: activation memory cap per rank, in microbatch-chunk units (a number) "
                        "or bytes (e.g. 24GiB, 512MB), measured while profiling")
    g.add_argument("--parallel-order", default="tp-cp-dp-pp",
                   help="rank order, fastest-varying first (Megatron's); an order without cp, e.g. tp-dp-pp, places "
                        "it right after tp")
    g.add_argument("--use-tp-pp-dp-mapping", dest="parallel_order", action="store_const", const="tp-cp-pp-dp",
                   help="Megatron's switch for the rank order tp-cp-pp-dp (pipeline before data parallel)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="None: nccl when CUDA is available, else gloo (Megatron's default is nccl)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of collective operations")
    g.add_argument("--hang-report-seconds", type=float, default=None,
                   help="when a training step (or the gradient reduction around it) makes no progress for this "
                        "long, every rank logs where it is in its plan and one report names the rank that stopped "
                        "first and the chain of waits behind it (also --save/hang_report.json), then the run exits "
                        "with status 1; 0: off, else at least 1; None: 300, or half of --distributed-timeout-minutes "
                        "when that is shorter (docs/reliability.md)")
    g.add_argument("--hang-report-keep-waiting", action="store_true",
                   help="after a hang report, keep waiting (a step that resumes goes on) instead of exiting")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over data-parallel ranks (ZeRO-1)")
    g.add_argument("--data-parallel-sharding-strategy", default="no_shard", action=_Given,
                   choices=SHARDING_STRATEGIES,
                   help="what data-parallel ranks shard: nothing (DDP), the optimizer state (ZeRO-1, like "
                        "--use-distributed-optimizer), also gradients (ZeRO-2) or also parameters (ZeRO-3); the last "
                        "two run on torch FSDP2")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="Megatron's alias for --data-parallel-sharding-strategy optim_grads_params (ZeRO-3 on FSDP2)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep the fp32 master weights and Adam moments on the CPU and run the update there")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's data-parallel all-reduce during the backward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per data-parallel gradient all-reduce bucket; None: 25000000")


def _add_context_parallel_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that split each sequence (context parallelism: two of 2N causal-balanced chunks per "
                        "rank, attention across them by --cp-comm-type)")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   help="context-parallel attention: p2p (ring: K/V passed around the CP ranks, overlapped with "
                        "compute), allgather (all-gather K/V, LLaMA 3's), a2a (Ulysses: an all-to-all swaps the "
                        "sequence split for a head split around attention; query groups per TP rank divisible by "
                        "the CP size) or a2a+p2p (a2a within --hierarchical-context-parallel-sizes' first level, "
                        "the ring across the second); one value, or one per layer all alike")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
                   help="A P for --cp-comm-type a2a+p2p (Megatron's): A consecutive CP ranks exchange heads by "
                        "all-to-all, the ring runs across the P groups; A x P = --context-parallel-size")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model", "Megatron requires --num-layers, --hidden-size, --num-attention-heads, "
                             "--max-position-embeddings and --seq-length; a --model preset supplies them instead, "
                             "and with neither the tiny preset is trained.")
    g.add_argument("--model", default=None, choices=tuple(PRESETS),
                   help="named architecture (of a model family: docs/model.md); shape flags override single "
                        "fields of it")
    shape = (("--num-layers", int, "transformer layers"), ("--hidden-size", int, "hidden size"),
             ("--ffn-hidden-size", int, "MLP hidden size; None: the preset's, or Megatron's rule "
                                        "int(4 * hidden * 2 / 3 / 64) * 64 with --swiglu, else 4 * hidden"),
             ("--num-attention-heads", int, "attention heads"),
             ("--num-query-groups", int, "key/value heads under --group-query-attention (Megatron's default 1); "
                                         "ignored without it"),
             ("--kv-channels", int, "head dim (q/k/v projections are heads x kv-channels wide); "
                                    "None: hidden-size / num-attention-heads"),
             ("--vocab-size", int, "vocabulary without padding; None: the tokenizer's or the preset's"),
             ("--max-position-embeddings", int, "longest sequence the RoPE tables cover"),
             ("--rotary-base", float, "RoPE theta; None: the preset's, else 10000"),
             ("--norm-epsilon", float, "RMSNorm epsilon; None: 1e-5"),
             ("--make-vocab-size-divisible-by", int, "pad the vocabulary to a multiple of this x TP; None: 128"),
             ("--init-method-std", float, "std of the normal weight init; None: 0.02"),
             ("--recompute-num-layers", int, "full recompute: layers per chunk recomputed"))
    for flag, typ, text in shape:
        g.add_argument(flag, type=typ, default=None, help=text)
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dims that RoPE rotates (the first ones); the rest pass unrotated")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1's RoPE frequency scaling (HF rope_type llama3: low and high frequency factors 1 "
                        "and 4, original context 8192, as Megatron applies it); the llama3.x presets have it")
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="the factor of --use-rope-scaling; None: the preset's, else 8.0 (Llama 3.1's and Megatron's "
                        "default; Llama 3.2 1B/3B use 32)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output-layer weights (LLaMA's; also llamapipe's default)")
    g.add_argument("--tie-embeddings-and-output-weights", action="store_true",
                   help="share the embedding with the output layer (across pipeline stages: two copies whose "
                        "gradients are summed, as Megatron keeps them)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recompute: whole layers, or only the attention core")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full recompute: every layer (uniform) or the first --recompute-num-layers (block)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-modules", nargs="+", default=None, metavar="NAME",
                   help="with --recompute-granularity selective: Megatron's parts of each layer to recompute, "
                        "core_attn (its default), mlp, layernorm")
    g.add_argument("--recompute-lgd", action="store_true",
                   help="the zero-bubble fork's: recompute each layer's norms and SwiGLU activation instead of storing "
                        "their outputs (LLaMA has no dropout)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="CUDA: run attention on SDPA's FlashAttention kernel (needs --bf16 or --fp16); "
                        "no effect on CPU")
    _add_llama_shape_flags(g)


def _add_llama_shape_flags(g: argparse._ArgumentGroup) -> None:
    """Flags of Megatron's LLaMA scripts that describe what the model here always is."""
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLP (always, here); also picks Megatron's --ffn-hidden-size rule")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in linear layers (always, here, but q/k/v under --add-qkv-bias)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the q, k and v projections: the qwen2 model family (Megatron's Qwen2 flag)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="RoPE (always, here)")
    g.add_argument("--normalization", choices=("RMSNorm",), default="RMSNorm",
                   help="only RMSNorm (LLaMA); Megatron's default LayerNorm is not available")
    g.add_argument("--position-embedding-type", choices=("rope",), default="rope",
                   help="only rope (LLaMA); Megatron's default learned_absolute is not available")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="only 0 (LLaMA pretraining uses no dropout; Megatron's default is 0.1)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="only 0 (LLaMA pretraining uses no dropout; Megatron's default is 0.1)")
