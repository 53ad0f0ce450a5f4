"""The split of decoder layers over (virtual) pipeline stages that balances the pipeline ranks' work, and the
per-component costs it balances: measured (a `llamapipe profile`, scaled to one tensor-parallel rank with its
collectives) or analytic (FLOPs, with the vocabulary layers counted at the vocabulary size).

Shared by `llamapipe plan --profile` (tools/profile_predict) and `--pipeline-model-parallel-layout auto`
(training/arguments/auto_layout), so the planner and the run choose the same split from the same costs.

Balancing: a rank's work per microbatch is F + B + W of all its chunks (`rank_work`): each chunk's decoder
layers, the embedding on virtual stage 0, the output layer with its loss on the last one, or, with vocabulary
parallelism (arXiv 2411.05288), 1/pp of both on every rank. `balanced_counts` starts from the even split and
moves one layer at a time from a stage of the busiest rank to a stage of another while that lowers the busiest
rank's work (each stage keeps a layer), which is how a user tunes --decoder-first/last-pipeline-num-layers.

Tensor parallelism (`tp_parts`): each component's compute divides by tp, and its collectives are charged one by
one at the profile's measured latency + bytes / bus bandwidth, as core/tensor_parallel issues them. A decoder
layer has two column-parallel groups (q/k/v, gate/up) and two row-parallel linears (o, down). Without sequence
parallelism: F all-reduces the two row outputs, B the two column input gradients. With it: F all-gathers the
two column inputs and reduce-scatters the two row outputs; B re-gathers the two column inputs (Megatron's
re-gather instead of keeping them alive), reduce-scatters their input gradients and all-gathers the two row
output gradients. Full recompute repeats F's collectives in B. gloo has no reduce-scatter: it is an all-reduce of
the whole tensor (core/tensor_parallel/mappings.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts

# One element of memory-bound work (read and write of a value: the embedding's dense gradient, the softmax over
# the logits) in FLOPs of GEMM work taking the same time. CPU: a CPU profile of a 256-wide model (benchmarks/results/
# bench_planner.json) has the embedding's backward (2.1 M gradient elements) take 1.8 ms, as long as 180 MFLOP of its
# layers' GEMMs, about 86 per element; CUDA: an H100's bf16 GEMMs at 60% of 989 TFLOP/s against 3.35 TB/s moving
# 12 bytes per element, about 2,000.
ELEMENT_FLOPS = {"cpu": 64.0, "cuda": 2000.0}
SOFTMAX_PASSES = 3          # max, exp-sum, and the gradient: passes over each logit in the loss


def stage_ranks(pp: int, vpp: int, placement: str) -> list[int]:
    """Pipeline rank of each virtual stage: "interleaved" (stage v on rank v % pp) or the V ("v")."""
    stages = pp * vpp
    if placement == "interleaved":
        return [stage % pp for stage in range(stages)]
    return [min(stage, 2 * pp - 1 - stage) for stage in range(stages)]


def rank_work(parts: dict[str, PassCosts], counts: Sequence[int], ranks: Sequence[int],
              vocab_parallel: bool = False) -> list[float]:
    """F + B + W of one microbatch on each pipeline rank (all its chunks) for the layer split `counts`."""
    pp = max(ranks) + 1
    work = [0.0] * pp
    total = {name: c.f + c.b + c.w for name, c in parts.items()}
    for stage, (rank, layers) in enumerate(zip(ranks, counts)):
        work[rank] += layers * total["layer"]
        if not vocab_parallel:
            work[rank] += total["embedding"] * (stage == 0) + total["head"] * (stage == len(counts) - 1)
    if vocab_parallel:
        work = [x + (total["embedding"] + total["head"]) / pp for x in work]
    return work


def even_counts(num_layers: int, stages: int) -> list[int]:
    """The even split, the first stages one layer more where it does not divide."""
    return [num_layers // stages + (s < num_layers % stages) for s in range(stages)]


def balanced_counts(parts: dict[str, PassCosts], num_layers: int, ranks: Sequence[int],
                    vocab_parallel: bool = False) -> list[int]:
    """The split of `num_layers` over the virtual stages (on `ranks`) that lowers the busiest rank's work,
    moving one layer at a time off the busiest rank; every stage keeps at least one layer."""
    stages = len(ranks)
    if num_layers < stages:
        raise ConfigError(f"num_layers {num_layers} is fewer than the {stages} virtual stages to split it over",
                          "num_layers")
    counts = even_counts(num_layers, stages)
    best = max(rank_work(parts, counts, ranks, vocab_parallel))
    while True:
        work = rank_work(parts, counts, ranks, vocab_parallel)
        busiest = work.index(max(work))
        trials = []
        for s in (s for s in range(stages) if ranks[s] == busiest and counts[s] > 1):
            for t in (t for t in range(stages) if ranks[t] != busiest):
                trial = list(counts)
                trial[s], trial[t] = trial[s] - 1, trial[t] + 1
                trials.append((max(rank_work(parts, trial, ranks, vocab_parallel)), trial))
        if not trials or min(trials)[0] >= best * (1 - 1e-9):
            return counts
        best, counts = min(trials)


def layout_string(counts: Sequence[int]) -> str:
    """A --pipeline-model-parallel-layout string for per-stage layer counts: [3, 5] -> "Et*3|t*5L"."""
    stages = [f"t*{n}" if n > 1 else "t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def analytic_parts(*, hidden: int, ffn_hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                   seq_length: int, micro_batch: int, recompute: str = "none",
                   element_flops: float = ELEMENT_FLOPS["cpu"]) -> dict[str, PassCosts]:
    """Per-microbatch F/B/W of a decoder layer, the embedding and the output layer + loss in FLOPs (relative
    units, for balancing only). GEMMs: 2 FLOPs per multiply-add in F, the same for B's input gradient and W's
    weight gradient; attention 4 s x heads x head_dim per token in F, twice that in B. The head's softmax costs
    `SOFTMAX_PASSES` element passes over the vocabulary per token; the embedding's backward writes a dense
    vocabulary x hidden gradient (per microbatch, as torch's dense embedding backward does)."""
    tokens = seq_length * micro_batch
    matmul = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * ffn_hidden
    attention = 4 * seq_length * heads * head_dim
    f, b = tokens * (2 * matmul + attention), tokens * (2 * matmul + 2 * attention)
    layer = PassCosts(f, b + (f if recompute == "full" else 0.0), tokens * 2 * matmul)
    gemm = tokens * 2 * vocab * hidden
    softmax = tokens * vocab * element_flops
    head = PassCosts(gemm + softmax * (SOFTMAX_PASSES - 1), gemm + softmax, gemm)
    embedding = PassCosts(tokens * hidden * element_flops, (vocab * hidden + tokens * hidden) * element_flops)
    return {"layer": layer, "embedding": embedding, "head": head}


def allreduce_s(comm: dict, nbytes: float, ranks: int) -> float:
    """A ring all-reduce of `nbytes` over `ranks` at the measured latency and bus bandwidth."""
    if ranks == 1:
        return 0.0
    return comm["allreduce_latency_s"] + 2 * (ranks - 1) / ranks * nbytes / comm["allreduce_bus_bandwidth_Bps"]


def allgather_s(comm: dict, nbytes: float, ranks: int) -> float:
    """An all-gather whose result is `nbytes`: half a ring all-reduce's traffic, the same latency."""
    if ranks == 1:
        return 0.0
    return comm["allreduce_latency_s"] + (ranks - 1) / ranks * nbytes / comm["allreduce_bus_bandwidth_Bps"]


def tp_comm_parts(comm: dict, message: float, tp: int, *, sequence_parallel: bool, recompute: str = "none",
                  gloo: bool = True, sync_s: float = 0.0) -> dict[str, PassCosts]:
    """Seconds of tensor-parallel collectives per microbatch in each component's F and B (see the module
    docstring); `message` is the bytes of one (s, b, h) activation, whole; `sync_s` is added to every collective
    (what a blocking wait for another rank costs beyond the transfer, see `tp_parts`)."""
    if tp == 1:
        return {name: PassCosts(0.0, 0.0) for name in ("layer", "embedding", "head")}
    reduce = allreduce_s(comm, message, tp) + sync_s
    gather = allgather_s(comm, message, tp) + sync_s
    scatter = reduce if gloo else gather            # gloo: an all-reduce of the whole tensor, then a slice
    small = 2 * (comm["allreduce_latency_s"] + sync_s)   # the loss's max and (sum, target logit) per token
    if sequence_parallel:
        layer_f, layer_b = 2 * gather + 2 * scatter, 4 * gather + 2 * scatter
        embedding, head = PassCosts(scatter, gather), PassCosts(gather + small, gather + scatter)
    else:
        layer_f, layer_b = 2 * reduce, 2 * reduce
        embedding, head = PassCosts(reduce, 0.0), PassCosts(small, reduce)
    if recompute == "full":
        layer_b += layer_f
    return {"layer": PassCosts(layer_f, layer_b), "embedding": embedding, "head": head}


def tp_parts(parts: dict[str, PassCosts], tp: int, slowdown: float = 1.0, comm: Optional[dict] = None, *,
             message: float = 0.0, sequence_parallel: bool = True, recompute: str = "none",
             gloo: bool = True, sync_s: float = 0.0) -> dict[str, PassCosts]:
    """Measured one-rank costs as one tp rank of `tp` runs them: compute (x `slowdown`, the CPU's
    oversubscription) over tp, activation bytes over tp, plus the collectives of `tp_comm_parts`.

    `sync_s`: on a CPU a gloo collective blocks its process until the other ranks arrive; the profile's
    all-reduce latency is measured with the ranks in lockstep, but in a step each collective is a wait that
    gives up the core and pays a wake-up, as a pipelined p2p message does (`profile_overhead`'s
    `pipeline_action_s - action_s`, the figure the caller passes)."""
    scaled = {name: c.scaled(slowdown / tp, 1.0 / tp) for name, c in parts.items()}
    if tp == 1:
        return scaled
    assert comm is not None, "tensor parallelism needs the profile's all-reduce figures"
    collectives = tp_comm_parts(comm, message, tp, sequence_parallel=sequence_parallel, recompute=recompute,
                                gloo=gloo, sync_s=sync_s)
    return {name: scaled[name] + collectives[name] for name in scaled}
