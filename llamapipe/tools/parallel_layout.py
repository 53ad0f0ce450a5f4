"""The layouts `llamapipe plan` ranks and what their memory and time models share: the Layout and Device
records, the verified plan each layout runs (the schedule's, with its offload actions or its Seq1F1B pieces),
the length of each sequence piece, the rank and decoder layers of each virtual stage and the parameters of each
pipeline rank. Memory: parallel_memory.py; step time and the `estimate` of both: parallel_estimate.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.offload_plan import with_offload
from llamapipe.core.pipeline_parallel.schedule_ir import Plan, splits_backward
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build, build_seq
from llamapipe.core.pipeline_parallel.seq_split import SeqSplits, piece_align
from llamapipe.core.pipeline_parallel.simulator import verify
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.llama.counts import layer_matmul_parameters

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
    cp_a2a: int = 0                         # a2a+p2p: the a2a level A of --hierarchical-context-parallel-sizes A P
    seq_splits: int = 1                     # --num-seq-splits K (Seq1F1B): each microbatch runs as K sequence pieces


@dataclass(frozen=True)
class Device:
    tflops: float               # dense bf16 peak per GPU
    link_gbps: float            # intra-node link per GPU and direction, gigabits per second
    internode_gbps: float = 400.0
    gpus_per_node: int = 8
    efficiency: float = 0.6     # share of the peak that the GEMMs reach
    host_gbps: float = 400.0    # device-host copies per GPU and direction (PCIe Gen5 x16: about 50 GB/s)


DEVICES = {"h100": Device(989.0, 3600.0), "h200": Device(989.0, 3600.0), "a100": Device(312.0, 2400.0)}


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
def seq_plan(schedule: str, pp: int, vpp: int, m: int, k: int) -> Plan:
    """The Seq1F1B plan of `m` microbatches in `k` pieces each (builders_seq.py, as the runtime builds it), verified."""
    plan = build_seq(schedule, pp, vpp, m, k)
    verify(plan)
    return plan


def layout_plan(lay: Layout, m: int) -> Plan:
    """The plan `lay` runs with `m` microbatches: its Seq1F1B pieces, or the schedule's with its offload."""
    if lay.seq_splits > 1:
        return seq_plan(lay.schedule, lay.pp, lay.vpp, m, lay.seq_splits)
    return offload_plan(lay.schedule, lay.pp, lay.vpp, m, lay.offload)


def piece_lengths(m: LlamaConfig, lay: Layout, seq: int) -> tuple[int, ...]:
    """Tokens of each Seq1F1B piece on one CP rank, as the runtime cuts them (training/setup.py `seq_splits`): the
    whole sequence into K pieces of equal FLOPs (--seq1f1b-balance-method's default, aligned as `piece_align`: to
    tp under sequence parallelism, to the 2 x cp chunks under CP), each piece then shared by the cp ranks;
    (seq / cp,) without splits."""
    if lay.seq_splits == 1:
        return (seq // lay.cp,)
    bounds = SeqSplits.for_model(lay.seq_splits, "flops", m.hidden_size, m.ffn_hidden_size, m.num_attention_heads,
                                 m.head_dim, m.num_query_groups,
                                 align=piece_align(lay.tp, lay.tp > 1, lay.cp)).bounds(seq)
    return tuple((b - a) // lay.cp for a, b in zip(bounds, bounds[1:]))


def stage_ranks(lay: Layout) -> list[int]:
    """Pipeline rank of each virtual stage under the schedule's placement."""
    stages = lay.pp * lay.vpp
    if SPECS[lay.schedule].placement(lay.vpp) == "interleaved":
        return [stage % lay.pp for stage in range(stages)]
    return [min(stage, 2 * lay.pp - 1 - stage) for stage in range(stages)]


def stage_layers(m: LlamaConfig, lay: Layout) -> list[int]:
    ranges = stage_layer_ranges(m.num_layers, lay.pp, lay.vpp, layout=lay.pipeline_layout)
    return [end - start for start, end in ranges]


def rank_params(m: LlamaConfig, lay: Layout) -> list[float]:
    """Parameters on each pipeline rank (per tp shard; the norms are whole on every tp rank)."""
    h, stages = m.hidden_size, lay.pp * lay.vpp
    layer = layer_matmul_parameters(m) / lay.tp + 2 * h
    vocab = m.padded_vocab_size(lay.tp) * h / lay.tp
    params = [0.0] * lay.pp
    for stage, (rank, layers) in enumerate(zip(stage_ranks(lay), stage_layers(m, lay))):
        params[rank] += layers * layer + (vocab if stage == 0 else 0) + (vocab + h if stage == stages - 1 else 0)
    return params
