"""Per-rank memory and step time of one parallel layout, for `llamapipe plan`.

The layouts and what both models share: parallel_layout.py; memory (weights, gradients, optimizer state,
activations walked over the schedule's plan, communication buffers): parallel_memory.py; both are re-exported here.

Time: a step's FLOPs (the model family's, llamapipe.model.families; LLaMA's and Qwen2's: 6 x matmul weights x tokens plus attention, plus one forward
again under full recompute) at `efficiency` x the device's peak, per-action costs fed to the simulator for
the pipeline makespan, plus TP all-reduces on the links and the DP gradient all-reduce. Seq1F1B (`seq_splits` K):
the simulator runs the pieces' plan (builders_seq.py) with each piece at 1/K of a microbatch's costs (the pieces
are FLOPs-balanced, seq_split.py); a short piece's lower kernel efficiency is not modelled.

Context parallelism (`cp`): every rank holds seq / cp tokens of each sequence, so activations and the FLOPs per
rank (attention included: the causal load balance gives each rank the same share) are divided by cp; the K/V
traffic is added where it is not hidden (`context_parallel_seconds`: ring, all-gather, a2a and a2a+p2p), and
gradients and ZeRO-1 shards span dp x cp.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from llamapipe.core.pipeline_parallel.simulator import Costs, run_timeline
from llamapipe.model.families import flops_per_token
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools.parallel_layout import (  # noqa: F401  (re-exported: the planner's one import)
    DEVICES, GIB, GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES, Device, Layout, layout_plan, offload_plan, piece_lengths,
    rank_params, seq_plan, stage_layers, stage_ranks, verified_plan)
from llamapipe.tools.parallel_memory import (  # noqa: F401
    RankMemory, activation_peaks, chunk_act_bytes, layer_act_bytes, plan_peaks, rank_memory)


@dataclass(frozen=True)
class Estimate:
    params: float               # bytes per rank (the most loaded rank)
    grads: float
    optimizer: float
    activations: float
    step_s: float
    mfu: float
    peak_units: float           # microbatch-chunk activations the plan holds on that rank
    comm: float = 0.0           # communication buffers beside them

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.comm


def estimate(m: LlamaConfig, lay: Layout, seq: int, global_batch: int, dev: Device) -> Estimate:
    """Memory of the most loaded rank and predicted step time / MFU of `lay`."""
    micro = global_batch // (lay.micro_batch * lay.dp)
    ranks = rank_memory(m, lay, seq, global_batch)
    best = max(ranks, key=lambda r: r.total)
    step = _step_seconds(m, lay, seq, micro, dev, max(r.params for r in ranks) / PARAM_BYTES[lay.precision])
    model_flops = flops_per_token(m, seq, lay.tp) * global_batch * seq
    mfu = model_flops / (step * lay.tp * lay.pp * lay.dp * lay.cp * dev.tflops * 1e12)
    return Estimate(best.params, best.grads, best.optimizer, best.activations, step_s=step, mfu=mfu,
                    peak_units=best.peak_units, comm=best.comm)


def _allreduce_s(nbytes: float, ranks: int, gbps: float) -> float:
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes * 8 / (gbps * 1e9)


def context_parallel_seconds(m: LlamaConfig, lay: Layout, seq: int, dev: Device) -> float:
    """Exposed K/V communication of one microbatch on one chunk under context parallelism (F + B). Each rank's
    K/V, (seq / cp) tokens x 2 kv-heads x head-dim / tp, reach the cp - 1 others in the forward; the backward
    moves them again and their gradients back (3 x). The ring (p2p) overlaps each transfer with a block of
    attention (hidden when attention is slower); the all-gather and its reduce-scatter are not overlapped.
    a2a (Ulysses): `a2a_seconds`, nothing overlaps it. a2a+p2p with levels A x P: the all-to-alls over A, then a
    ring over P of seq / P tokens for 1/A of the query groups (the same bytes a step as the plain ring's, P - 1
    steps instead of cp - 1), overlapped with the same attention. With Seq1F1B pieces the ring and the all-gather
    send each piece with the earlier pieces' shards (sum of the pieces' ends / the sequence: (K + 1) / 2 for equal
    pieces, more for the FLOPs-balanced ones, which start long)."""
    if lay.cp == 1:
        return 0.0
    a2a = {"a2a": lay.cp, "a2a+p2p": lay.cp_a2a}.get(lay.cp_comm, 1)
    exposed = a2a_seconds(m, lay, seq, dev, a2a) if a2a > 1 else 0.0
    ring = lay.cp // a2a
    if ring == 1:
        return exposed
    kv = 2 * m.num_query_groups * m.head_dim / lay.tp * PARAM_BYTES[lay.precision]     # bytes of one token's K and V
    # Seq1F1B: each piece's message carries this rank's shards of the earlier pieces too (ring_pieces.py, pieces.py)
    resent = sum(itertools.accumulate(piece_lengths(m, lay, seq))) / (seq // lay.cp)
    kv_bytes = seq / lay.cp * lay.micro_batch * kv * resent
    gbps = dev.link_gbps if lay.tp * lay.cp <= dev.gpus_per_node else dev.internode_gbps
    layers = m.num_layers / (lay.pp * lay.vpp)
    comm = layers * 3 * (ring - 1) * kv_bytes * 8 / (gbps * 1e9)
    if lay.cp_comm == "allgather":
        return comm
    attention = (flops_per_token(m, seq, lay.tp) - flops_per_token(m, 0, lay.tp)) * seq * lay.micro_batch
    attention_s = attention / (lay.tp * lay.pp * lay.vpp * lay.cp) / (dev.tflops * 1e12 * dev.efficiency)
    return exposed + max(0.0, comm - attention_s)


def a2a_seconds(m: LlamaConfig, lay: Layout, seq: int, dev: Device, size: int = 0) -> float:
    """The exposed all-to-all time of one microbatch on one chunk (F + B) over `size` CP ranks (default: all of
    them, a2a; a2a+p2p: its a2a level): q and the output (heads), k and v (query groups) of seq / cp tokens,
    (size - 1) / size of them leaving the rank, forward and backward, on NVLink while tp x size ranks fit a node."""
    size = size or lay.cp
    width = (2 * m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim / lay.tp
    sent = seq / lay.cp * lay.micro_batch * width * PARAM_BYTES[lay.precision] * (size - 1) / size
    gbps = dev.link_gbps if lay.tp * size <= dev.gpus_per_node else dev.internode_gbps
    return m.num_layers / (lay.pp * lay.vpp) * 2 * sent * 8 / (gbps * 1e9)


@functools.lru_cache(maxsize=None)
def _makespan(schedule: str, pp: int, vpp: int, m: int, k: int, costs: Costs) -> float:
    """The simulated makespan of a verified plan (layouts that differ only in ZeRO-1 have the same costs); with K
    Seq1F1B pieces a microbatch, each piece costs 1/K of the microbatch (`Costs.pieces`)."""
    plan = seq_plan(schedule, pp, vpp, m, k) if k > 1 else verified_plan(schedule, pp, vpp, m)
    return max(row[-1][1] for row in run_timeline(plan, costs.pieces(k)) if row)


def _step_seconds(m: LlamaConfig, lay: Layout, seq: int, micro: int, dev: Device, params_on_rank: float) -> float:
    tokens = seq * lay.micro_batch // lay.cp                      # this CP rank's tokens of one microbatch
    # the slowest virtual stage sets the pace: one with the most layers (an uneven layout; 1 x the mean when even)
    slowest = max(stage_layers(m, lay)) * lay.pp * lay.vpp / m.num_layers
    flops = flops_per_token(m, seq, lay.tp, lay.recompute == "full") * tokens / (lay.tp * lay.pp * lay.vpp)
    chunk = slowest * flops / (dev.tflops * 1e12 * dev.efficiency)    # F + B + W of one microbatch on one chunk
    chunk += context_parallel_seconds(m, lay, seq, dev)
    tp_gbps = dev.link_gbps if lay.tp <= dev.gpus_per_node else dev.internode_gbps
    tp_comm = 4 * max(stage_layers(m, lay)) * _allreduce_s(2 * tokens * m.hidden_size, lay.tp, tp_gbps)
    share = (0.25, 0.5, 0.25) if lay.recompute == "full" else (1 / 3, 1 / 3, 1 / 3)   # B re-runs the forward
    f, b, w = (chunk * x + tp_comm * y for x, y in zip(share, (0.5, 0.5, 0.0)))
    hop = 2 * tokens * m.hidden_size / lay.tp * 8 / (dev.internode_gbps * 1e9)
    simulated = min(micro, 4 * lay.pp)              # the steady state adds one round per further microbatch
    if lay.pp == 1:
        pipeline = micro * (f + b + w)
    else:
        pipeline = _makespan(lay.schedule, lay.pp, lay.vpp, simulated, lay.seq_splits, Costs(f=f, b=b, w=w, comm=hop))
        pipeline += (micro - simulated) * lay.vpp * (f + b + w)
    if lay.offload:     # the copies overlap compute while they fit in it (PipeOffload); past that the step waits
        m_b = max(sum(saved for saved, _ in units) for units in chunk_act_bytes(m, lay, seq))
        copy_s = 2 * m_b * 8 / (dev.host_gbps * 1e9)                # D2H after F, H2D before B
        pipeline += micro * lay.offload * max(0.0, copy_s - (f + b + w))
    dp_gbps = dev.link_gbps if lay.tp * lay.cp * lay.dp <= dev.gpus_per_node else dev.internode_gbps
    return pipeline + _allreduce_s(4 * params_on_rank, lay.dp * lay.cp, dp_gbps)   # gradients over dp x cp
