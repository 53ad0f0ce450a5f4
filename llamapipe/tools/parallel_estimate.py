"""Per-rank memory and step time of one parallel layout, for `llamapipe plan`.

Memory per pipeline rank, counted for what this trainer allocates (validated against measured storages in
tests/multiproc/test_planner_memory.py, docs/planner.md):

- weights: parameters counted exactly for the LLaMA shape on every rank (the placement and the layout decide
  which rank holds the embedding and the head; norms are replicated over tp), 2 bytes each under bf16, 4 in fp32;
- gradients: 4 bytes (bf16 parameters accumulate fp32 `.grad`, Megatron's main_grad);
- optimizer: Adam's m and v (8 bytes) plus an fp32 master copy under bf16 (4), divided over dp by the
  distributed optimizer (ZeRO-1), Megatron-LM's theoretical model (megatron/training/theoretical_memory_usage.py);
- activations, per token of one microbatch and one decoder layer, what autograd saves here (not Megatron's GPT
  formula of Korthikanti et al., arXiv 2205.05198, which assumes a 2-matrix GeLU MLP and stored attention scores):
  the two RMSNorms 16h bytes (input and output, or fp32 input, bf16 normed and output), q, k, v and the attention
  output e(2 hd + 2 kv) (flash/SDPA: no s^2 scores, so selective recompute saves nothing more), SwiGLU's gate, up,
  silu(gate) and product 4ef, all divided by tp (sequence parallelism); full recompute keeps the layer input eh/tp.
  The last stage adds the final norm and the fp32 softmax of the vocabulary-parallel loss 4V/tp. Zero-bubble B
  leaves for W the linears' inputs and output gradients, e(4h + (2 hd + 2 kv + 3f)/tp) (the inputs of the
  column-parallel linears and the gradients of the row-parallel outputs are sequence-gathered), also under full
  recompute. The schedule's plan is walked action by action with these per-chunk bytes (F adds M_B, B swaps it
  for M_W, W frees M_W), so uneven layouts and the V placement's two different chunks are exact.
- communication buffers: the pipeline receives posted ahead, the gradient reduction's fp32 buckets and ZeRO-1's
  all-gather of the updated parameters, counted by core/comm_memory.py, the one model `llamapipe dry-run` counts
  them with (tools/comm_estimate.py supplies the layout's side).

Time: a step's FLOPs (the model family's, llamapipe.model.families; LLaMA's and Qwen2's: 6 x matmul weights x tokens plus attention, plus one forward
again under full recompute) at `efficiency` x the device's peak, per-action costs fed to the simulator for
the pipeline makespan, plus TP all-reduces on the links and the DP gradient all-reduce.

Context parallelism (`cp`): every rank holds seq / cp tokens of each sequence, so activations and the FLOPs per
rank (attention included: the causal load balance gives each rank the same share) are divided by cp; the K/V
traffic is added where it is not hidden (`context_parallel_seconds`), and gradients and ZeRO-1 shards span dp x cp.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.offload_plan import with_offload
from llamapipe.core.pipeline_parallel.schedule_ir import Plan, splits_backward
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, run_timeline, verify
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools.comm_estimate import rank_comm_bytes
from llamapipe.model.llama.counts import layer_matmul_parameters
from llamapipe.model.families import flops_per_token
from llamapipe.model.recompute import LGD, saved_bytes_per_token

GIB = 2 ** 30
PARAM_BYTES = {"bf16": 2, "fp32": 4}
OPTIMIZER_BYTES = {"bf16": 12, "fp32": 8}      # Adam m and v, plus the fp32 master of bf16 weights
GRAD_BYTES = 4


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
    precision: str = "bf16"     # "bf16" (fp32 master weights) or "fp32"
    pipeline_layout: Optional[str] = None   # a --pipeline-model-parallel-layout string; None: even split
    vocab_parallel: bool = False            # output layer split over the pipeline ranks (--enable-vocab-parallel)
    cp: int = 1                             # --context-parallel-size: ranks splitting each sequence
    cp_comm: str = "p2p"                    # --cp-comm-type: ring (overlapped), all-gather of K/V or a2a
    offload: int = 0                        # --cpu-offload --offload-chunk-num N: chunks 0..N-1 offload (PipeOffload)


@dataclass(frozen=True)
class Device:
    tflops: float               # dense bf16 peak per GPU
    link_gbps: float            # intra-node link per GPU and direction, gigabits per second
    internode_gbps: float = 400.0
    gpus_per_node: int = 8
    efficiency: float = 0.6     # share of the peak that the GEMMs reach
    host_gbps: float = 400.0    # device-host copies per GPU and direction (PCIe Gen5 x16: about 50 GB/s)


DEVICES = {"h100": Device(989.0, 3600.0), "h200": Device(989.0, 3600.0), "a100": Device(312.0, 2400.0)}


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of a pipeline stage holds at its peak."""
    params: float
    grads: float
    optimizer: float
    activations: float
    peak_units: float           # the activation peak in microbatches of the rank's largest chunk
    comm: float                 # communication buffers (core/comm_memory.py, the dry run's model)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.comm


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


def layer_act_bytes(m: LlamaConfig, seq: int, mbs: int, recompute: str, precision: str = "bf16",
                    tp: int = 1) -> tuple[float, float]:
    """(bytes held from F to B, bytes held from B to W) by one decoder layer for one microbatch on one tp rank."""
    e, h, f = PARAM_BYTES[precision], m.hidden_size, m.ffn_hidden_size
    hd, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    tokens = seq * mbs
    saved = e * h / tp if recompute == "full" else (16 * h + e * (2 * hd + 2 * kv + 4 * f) + 8) / tp
    if recompute == "lgd":      # the fork's --recompute-lgd: the norms' outputs and the activation's are not kept
        saved -= saved_bytes_per_token(m, frozenset(LGD), e, tp, sequence_parallel=True)
    # W holds, per token: the inputs of q/k/v and gate/up (sequence shards under sequence parallelism: W gathers
    # them again), the o and down inputs and every linear's output gradient (o's and down's gathered: 2h)
    held = e * (2 * h + (2 * h + 2 * hd + 2 * kv + 3 * f) / tp)
    return tokens * saved, tokens * held


def _head_act_bytes(m: LlamaConfig, seq: int, mbs: int, precision: str, tp: int) -> tuple[float, float]:
    """(F->B, B->W) bytes of the final norm, output layer and loss for one microbatch on one tp rank."""
    e, h, vocab = PARAM_BYTES[precision], m.hidden_size, m.padded_vocab_size(tp)
    return seq * mbs * (8 * h + 4 + 4 * vocab) / tp, seq * mbs * e * (h + vocab / tp)


@functools.lru_cache(maxsize=None)
def verified_plan(schedule: str, pp: int, vpp: int, m: int) -> Plan:
    """The schedule's plan, built and verified by the simulator once: `plan` asks for the same ones many times."""
    plan = build(schedule, pp, vpp, m)
    verify(plan)
    return plan


@functools.lru_cache(maxsize=None)
def offload_plan(schedule: str, pp: int, vpp: int, m: int, offload: int) -> Plan:
    """The verified plan with the O/R of `offload` chunks per rank, as the executor places them on a GPU (the reload
    one backward ahead), and on a zero-bubble schedule the OW/RW of what its deferred Ws hold
    (--offload-weight-grad-inputs); the plan itself when `offload` is 0."""
    plan = verified_plan(schedule, pp, vpp, m)
    return with_offload(plan, offload, reload_lead=1, held=splits_backward(plan)) if offload else plan


@functools.lru_cache(maxsize=None)
def _makespan(schedule: str, pp: int, vpp: int, m: int, costs: Costs) -> float:
    """The simulated makespan of a verified plan (layouts that differ only in ZeRO-1 have the same costs)."""
    return max(row[-1][1] for row in run_timeline(verified_plan(schedule, pp, vpp, m), costs) if row)


def stage_ranks(lay: Layout) -> list[int]:
    """Pipeline rank of each virtual stage under the schedule's placement."""
    stages = lay.pp * lay.vpp
    if SPECS[lay.schedule].placement(lay.vpp) == "interleaved":
        return [stage % lay.pp for stage in range(stages)]
    return [min(stage, 2 * lay.pp - 1 - stage) for stage in range(stages)]


def _stage_layers(m: LlamaConfig, lay: Layout) -> list[int]:
    ranges = stage_layer_ranges(m.num_layers, lay.pp, lay.vpp, layout=lay.pipeline_layout)
    return [end - start for start, end in ranges]


def rank_params(m: LlamaConfig, lay: Layout) -> list[float]:
    """Parameters on each pipeline rank (per tp shard; the norms are whole on every tp rank)."""
    h, stages = m.hidden_size, lay.pp * lay.vpp
    layer = layer_matmul_parameters(m) / lay.tp + 2 * h
    vocab = m.padded_vocab_size(lay.tp) * h / lay.tp
    params = [0.0] * lay.pp
    for stage, (rank, layers) in enumerate(zip(stage_ranks(lay), _stage_layers(m, lay))):
        params[rank] += layers * layer + (vocab if stage == 0 else 0) + (vocab + h if stage == stages - 1 else 0)
    return params


def _chunk_act_bytes(m: LlamaConfig, lay: Layout, seq: int) -> list[tuple[float, float]]:
    """(M_B, M_W) bytes of each virtual stage for one microbatch; a CP rank holds seq / cp of its tokens (ring
    attention saves only local q, k, v, output and log-sum-exp; all-gathered K/V are transient)."""
    seq = seq // lay.cp
    saved, held = layer_act_bytes(m, seq, lay.micro_batch, lay.recompute, lay.precision, lay.tp)
    head = _head_act_bytes(m, seq, lay.micro_batch, lay.precision, lay.tp)
    last = lay.pp * lay.vpp - 1
    return [(n * saved + (head[0] if s == last else 0), n * held + (head[1] if s == last else 0))
            for s, n in enumerate(_stage_layers(m, lay))]


_DELTA = {"F": (1, 0), "B": (-1, 1), "W": (0, -1), "BW": (-1, 0), "O": (-1, 0), "R": (1, 0), "OW": (0, -1),
          "RW": (0, 1)}     # what each action adds to a rank's activations, in (M_B, M_W) of its chunk


@functools.lru_cache(maxsize=4096)
def _peak_terms(plan: Plan) -> tuple:
    """Per rank: each action's chunk, its (M_B, M_W) coefficients, and whether it is a BW that sends (which holds
    M_W for a moment), as arrays: the part of `plan_peaks` that depends on the plan alone, built once."""
    rows = []
    for rank, actions in enumerate(plan.actions):
        chunks = np.array([a.chunk for a in actions], dtype=np.int64)
        coef = np.array([_DELTA[a.kind] for a in actions], dtype=np.float64).reshape(-1, 2)
        sends = np.array([a.kind == "BW" and plan.stage_of(rank, a.chunk) > 0
                          and plan.rank_chunk_of(plan.stage_of(rank, a.chunk) - 1)[0] != rank for a in actions],
                         dtype=bool)
        rows.append((chunks, coef, sends))
    return tuple(rows)


def plan_peaks(plan: Plan, chunk_bytes: list[list[tuple[float, float]]]) -> list[float]:
    """Peak activation bytes of each rank over `plan`: F adds the chunk's M_B, B keeps its M_W instead, W frees
    M_W, BW frees M_B (`chunk_bytes[rank][chunk]`: (M_B, M_W)). A BW that sends to another rank runs as B, send,
    W in the executor, so it holds M_W for a moment: more than M_B under full recompute, whose B re-creates the
    inputs W needs. An O (offload) moves the M_B to host memory and its R brings it back."""
    peaks = []
    for (chunks, coef, sends), sizes in zip(_peak_terms(plan), chunk_bytes):
        if not len(chunks):
            peaks.append(0.0)
            continue
        bytes_ = np.asarray(sizes, dtype=np.float64)[chunks]          # (M_B, M_W) of each action's chunk
        delta = coef[:, 0] * bytes_[:, 0] + coef[:, 1] * bytes_[:, 1]
        level = np.cumsum(delta)
        transient = (level - delta - bytes_[:, 0] + bytes_[:, 1])[sends]
        peaks.append(float(max(0.0, level.max(), transient.max(initial=0.0))))
    return peaks


def activation_peaks(m: LlamaConfig, lay: Layout, seq: int, m_micro: int) -> list[float]:
    """Peak activation bytes per pipeline rank (m capped at 4 pp: the peak is reached early)."""
    per_stage = _chunk_act_bytes(m, lay, seq)
    if lay.pp == 1:
        return [per_stage[0][0]]
    plan = offload_plan(lay.schedule, lay.pp, lay.vpp, min(m_micro, 4 * lay.pp), lay.offload)
    ranks = stage_ranks(lay)
    # a rank's chunks in stage order: interleaved r, r + p, ...; V placement r, 2p - 1 - r
    chunk_bytes = [[per_stage[s] for s in range(len(ranks)) if ranks[s] == r] for r in range(lay.pp)]
    return plan_peaks(plan, chunk_bytes)


def rank_memory(m: LlamaConfig, lay: Layout, seq: int, global_batch: int) -> list[RankMemory]:
    """What each pipeline rank holds at its activation peak."""
    micro = global_batch // (lay.micro_batch * lay.dp)
    per_stage = _chunk_act_bytes(m, lay, seq)
    largest = max(b for b, _ in per_stage)
    opt_bytes = OPTIMIZER_BYTES[lay.precision] / (lay.dp * lay.cp if lay.dist_opt else 1)   # ZeRO-1 over dp x cp
    comm = rank_comm_bytes(m, lay, seq, stage_ranks(lay), _stage_layers(m, lay), PARAM_BYTES[lay.precision])
    return [RankMemory(PARAM_BYTES[lay.precision] * p, GRAD_BYTES * p, opt_bytes * p, act, act / largest, c)
            for p, act, c in zip(rank_params(m, lay), activation_peaks(m, lay, seq, micro), comm)]


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
    a2a (Ulysses): four all-to-alls per layer in the forward (q, k, v in; the output back) and four in the backward,
    each rank keeping 1/cp of what it holds and sending the rest; nothing overlaps them."""
    if lay.cp == 1:
        return 0.0
    if lay.cp_comm == "a2a":
        return a2a_seconds(m, lay, seq, dev)
    kv_bytes = seq / lay.cp * lay.micro_batch * 2 * m.num_query_groups * m.head_dim / lay.tp * PARAM_BYTES[lay.precision]
    gbps = dev.link_gbps if lay.tp * lay.cp <= dev.gpus_per_node else dev.internode_gbps
    layers = m.num_layers / (lay.pp * lay.vpp)
    comm = layers * 3 * (lay.cp - 1) * kv_bytes * 8 / (gbps * 1e9)
    if lay.cp_comm == "allgather":
        return comm
    attention = (flops_per_token(m, seq, lay.tp) - flops_per_token(m, 0, lay.tp)) * seq * lay.micro_batch
    attention_s = attention / (lay.tp * lay.pp * lay.vpp * lay.cp) / (dev.tflops * 1e12 * dev.efficiency)
    return max(0.0, comm - attention_s)


def a2a_seconds(m: LlamaConfig, lay: Layout, seq: int, dev: Device) -> float:
    """a2a's exposed all-to-all time of one microbatch on one chunk (F + B): q and the output (heads), k and v
    (query groups) of seq / cp tokens, (cp - 1) / cp of them leaving the rank, forward and backward."""
    width = (2 * m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim / lay.tp
    sent = seq / lay.cp * lay.micro_batch * width * PARAM_BYTES[lay.precision] * (lay.cp - 1) / lay.cp
    gbps = dev.link_gbps if lay.tp * lay.cp <= dev.gpus_per_node else dev.internode_gbps
    return m.num_layers / (lay.pp * lay.vpp) * 2 * sent * 8 / (gbps * 1e9)


def _step_seconds(m: LlamaConfig, lay: Layout, seq: int, micro: int, dev: Device, params_on_rank: float) -> float:
    tokens = seq * lay.micro_batch // lay.cp                      # this CP rank's tokens of one microbatch
    # the slowest virtual stage sets the pace: one with the most layers (an uneven layout; 1 x the mean when even)
    slowest = max(_stage_layers(m, lay)) * lay.pp * lay.vpp / m.num_layers
    flops = flops_per_token(m, seq, lay.tp, lay.recompute == "full") * tokens / (lay.tp * lay.pp * lay.vpp)
    chunk = slowest * flops / (dev.tflops * 1e12 * dev.efficiency)    # F + B + W of one microbatch on one chunk
    chunk += context_parallel_seconds(m, lay, seq, dev)
    tp_gbps = dev.link_gbps if lay.tp <= dev.gpus_per_node else dev.internode_gbps
    tp_comm = 4 * max(_stage_layers(m, lay)) * _allreduce_s(2 * tokens * m.hidden_size, lay.tp, tp_gbps)
    share = (0.25, 0.5, 0.25) if lay.recompute == "full" else (1 / 3, 1 / 3, 1 / 3)   # B re-runs the forward
    f, b, w = (chunk * x + tp_comm * y for x, y in zip(share, (0.5, 0.5, 0.0)))
    hop = 2 * tokens * m.hidden_size / lay.tp * 8 / (dev.internode_gbps * 1e9)
    simulated = min(micro, 4 * lay.pp)              # the steady state adds one round per further microbatch
    if lay.pp == 1:
        pipeline = micro * (f + b + w)
    else:
        pipeline = _makespan(lay.schedule, lay.pp, lay.vpp, simulated, Costs(f=f, b=b, w=w, comm=hop))
        pipeline += (micro - simulated) * lay.vpp * (f + b + w)
    if lay.offload:     # the copies overlap compute while they fit in it (PipeOffload); past that the step waits
        m_b = max(saved for saved, _ in _chunk_act_bytes(m, lay, seq))
        copy_s = 2 * m_b * 8 / (dev.host_gbps * 1e9)                # D2H after F, H2D before B
        pipeline += micro * lay.offload * max(0.0, copy_s - (f + b + w))
    dp_gbps = dev.link_gbps if lay.tp * lay.cp * lay.dp <= dev.gpus_per_node else dev.internode_gbps
    return pipeline + _allreduce_s(4 * params_on_rank, lay.dp * lay.cp, dp_gbps)   # gradients over dp x cp
