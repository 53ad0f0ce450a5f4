"""Per-rank memory and step time of one parallel layout, for `llamapipe plan`.

Memory follows Megatron-LM's theoretical model (megatron/training/theoretical_memory_usage.py; Korthikanti et al.,
arXiv 2205.05198, Table 2): bf16 weights (2 bytes), fp32 gradients (4) and Adam's fp32 master, m and v (12), the
last 12 sharded over data-parallel ranks by the distributed optimizer. Parameters are counted exactly for the
LLaMA shape on every pipeline rank (the placement decides which rank holds the embedding and the head). Activations
per layer and microbatch: s*b*h*(18 + 4*f/h) bytes under selective recompute (Megatron's 34 s*b*h for f = 4h), plus
5*a*s^2*b for the attention scores without recompute, 2*s*b*h (the layer input) under full recompute, all divided
by tp (sequence parallelism). How many microbatches each rank holds comes from the schedule's plan in the
simulator (M_W = 0.87 of a unit, measured on LLaMA chunks, see docs/schedules.md), not from a closed form.

Time: a step's FLOPs (6 x parameters x tokens plus attention, plus one forward again under full recompute) at
`efficiency` x the device's peak, per-action costs fed to the simulator for the pipeline makespan, plus TP
all-reduces on the links and the DP gradient all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass

from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.model.config import LlamaConfig

GIB = 2 ** 30
W_SHARE = 0.87          # share of a unit the deferred W holds (docs/schedules.md, measured on LLaMA chunks)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    schedule: str
    micro_batch: int
    recompute: str              # "none", "selective" or "full"
    dist_opt: bool


@dataclass(frozen=True)
class Device:
    tflops: float               # dense bf16 peak per GPU
    link_gbps: float            # intra-node link per GPU and direction, gigabits per second
    internode_gbps: float = 400.0
    gpus_per_node: int = 8
    efficiency: float = 0.6     # share of the peak that the GEMMs reach


DEVICES = {"h100": Device(989.0, 3600.0), "h200": Device(989.0, 3600.0), "a100": Device(312.0, 2400.0)}


@dataclass(frozen=True)
class Estimate:
    params: float               # bytes per rank (the most loaded rank)
    grads: float
    optimizer: float
    activations: float
    step_s: float
    mfu: float
    peak_units: float           # microbatch-chunk activations the plan holds on that rank

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def layer_params(m: LlamaConfig) -> int:
    h, kv = m.hidden_size, m.num_query_groups * m.head_dim
    return h * m.num_attention_heads * m.head_dim * 2 + 2 * h * kv + 3 * h * m.ffn_hidden_size + 2 * h


def layer_act_bytes(m: LlamaConfig, seq: int, mbs: int, recompute: str) -> float:
    """Bytes one layer keeps for one microbatch, before the division by tp."""
    sbh = seq * mbs * m.hidden_size
    if recompute == "full":
        return 2 * sbh
    act = sbh * (18 + 4 * m.ffn_hidden_size / m.hidden_size)
    return act + (5 * m.num_attention_heads * seq * seq * mbs if recompute == "none" else 0)


def _rank_params(m: LlamaConfig, lay: Layout) -> list[float]:
    """Parameters on each pipeline rank (per tp shard)."""
    ranges = stage_layer_ranges(m.num_layers, lay.pp, lay.vpp)
    placement, stages = SPECS[lay.schedule].placement(lay.vpp), lay.pp * lay.vpp
    vocab = m.padded_vocab_size(lay.tp) * m.hidden_size
    params = [0.0] * lay.pp
    for stage, (start, end) in enumerate(ranges):
        rank = stage % lay.pp if placement == "interleaved" else min(stage, 2 * lay.pp - 1 - stage)
        params[rank] += (end - start) * layer_params(m) + (vocab if stage == 0 else 0)
        params[rank] += vocab + m.hidden_size if stage == stages - 1 else 0
    return [p / lay.tp for p in params]


def _plan_memory(lay: Layout, m_micro: int) -> list[float]:
    """Peak activation units per rank from the schedule's plan (m capped: the peak is reached early)."""
    if lay.pp == 1:
        return [1.0]
    plan = build(lay.schedule, lay.pp, lay.vpp, min(m_micro, 4 * lay.pp))
    return simulate(plan, Costs(w_mem=W_SHARE)).peak_memory


def _allreduce_s(nbytes: float, ranks: int, gbps: float) -> float:
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes * 8 / (gbps * 1e9)


def estimate(m: LlamaConfig, lay: Layout, seq: int, global_batch: int, dev: Device) -> Estimate:
    """Memory of the most loaded rank and predicted step time / MFU of `lay`."""
    micro = global_batch // (lay.micro_batch * lay.dp)
    rank_params, units = _rank_params(m, lay), _plan_memory(lay, micro)
    layers_per_chunk = m.num_layers / (lay.pp * lay.vpp)
    unit_bytes = layers_per_chunk * layer_act_bytes(m, seq, lay.micro_batch, lay.recompute) / lay.tp
    logits = 4 * seq * lay.micro_batch * m.padded_vocab_size(lay.tp) / lay.tp      # fp32 loss of one microbatch
    opt_bytes = 12 / lay.dp if lay.dist_opt else 12
    best = None
    for rank, (p, u) in enumerate(zip(rank_params, units)):
        working = logits if rank == (lay.pp - 1 if SPECS[lay.schedule].placement(lay.vpp) == "interleaved" else 0) \
            else 0.0
        row = (2 * p, 4 * p, opt_bytes * p, u * unit_bytes + working, u)
        if best is None or sum(row[:4]) > sum(best[:4]):
            best = row
    step = _step_seconds(m, lay, seq, micro, dev, max(rank_params))
    model_flops = _flops_per_token(m, seq, full_recompute=False) * global_batch * seq
    mfu = model_flops / (step * lay.tp * lay.pp * lay.dp * dev.tflops * 1e12)
    return Estimate(*best[:4], step_s=step, mfu=mfu, peak_units=best[4])


def _flops_per_token(m: LlamaConfig, seq: int, full_recompute: bool) -> float:
    """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus causal attention, 8 with full recompute."""
    per_weight = 8 if full_recompute else 6
    dense = m.num_layers * layer_params(m) + m.padded_vocab_size() * m.hidden_size
    attention = m.num_layers * 2 * seq * m.num_attention_heads * m.head_dim    # QK^T and AV, causal half
    return per_weight * dense + per_weight * attention


def _step_seconds(m: LlamaConfig, lay: Layout, seq: int, micro: int, dev: Device, rank_params: float) -> float:
    tokens = seq * lay.micro_batch
    flops = _flops_per_token(m, seq, lay.recompute == "full") * tokens / (lay.tp * lay.pp * lay.vpp)
    chunk = flops / (dev.tflops * 1e12 * dev.efficiency)          # F + B + W of one microbatch on one chunk
    tp_gbps = dev.link_gbps if lay.tp <= dev.gpus_per_node else dev.internode_gbps
    tp_comm = 4 * (m.num_layers / (lay.pp * lay.vpp)) * _allreduce_s(2 * tokens * m.hidden_size, lay.tp, tp_gbps)
    share = (0.25, 0.5, 0.25) if lay.recompute == "full" else (1 / 3, 1 / 3, 1 / 3)   # B re-runs the forward
    f, b, w = (chunk * x + tp_comm * y for x, y in zip(share, (0.5, 0.5, 0.0)))
    hop = 2 * tokens * m.hidden_size / lay.tp * 8 / (dev.internode_gbps * 1e9)
    simulated = min(micro, 4 * lay.pp)              # the steady state adds one round per further microbatch
    if lay.pp == 1:
        pipeline = micro * (f + b + w)
    else:
        plan = build(lay.schedule, lay.pp, lay.vpp, simulated)
        pipeline = simulate(plan, Costs(f=f, b=b, w=w, comm=hop)).makespan
        pipeline += (micro - simulated) * lay.vpp * (f + b + w)
    dp_gbps = dev.link_gbps if lay.tp * lay.dp <= dev.gpus_per_node else dev.internode_gbps
    return pipeline + _allreduce_s(4 * rank_params, lay.dp, dp_gbps)
