"""Per-rank memory of one parallel layout, for `llamapipe plan` (validated against measured storages in
tests/multiproc/test_planner_memory.py and against the dry run in tests/unit/test_dry_run_plan.py, docs/planner.md):

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
  for M_W, W frees M_W), so uneven layouts and the V placement's two different chunks are exact. Seq1F1B
  (`seq_splits` K): the plan's units are pieces, each with the bytes of its own tokens (`chunk_act_bytes`).
- communication buffers: the pipeline receives posted ahead, the gradient reduction's fp32 buckets and ZeRO-1's
  all-gather of the updated parameters, counted by core/comm_memory.py, the one model `llamapipe dry-run` counts
  them with (tools/comm_estimate.py supplies the layout's side).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.recompute import LGD, saved_bytes_per_token
from llamapipe.tools.comm_estimate import rank_comm_bytes
from llamapipe.tools.parallel_layout import (GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES, Layout, layout_plan,
                                             piece_lengths, rank_params, stage_layers, stage_ranks)


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


def chunk_act_bytes(m: LlamaConfig, lay: Layout, seq: int) -> list[list[tuple[float, float]]]:
    """(M_B, M_W) bytes of each virtual stage for one unit of the plan: one entry per Seq1F1B piece (one for the
    whole microbatch without splits). A CP rank holds seq / cp of its tokens (ring attention saves only local q, k,
    v, output and log-sum-exp; all-gathered K/V are transient). A piece saves what `layer_act_bytes` counts for
    its own tokens: the earlier pieces' keys and values it attends to are their own saved tensors, which the
    piece cache (model/piece_attention.py) holds until their backward; under full recompute the cache's keys and
    values are kept beside the layer input, and every piece but the last gets its key/value gradients added up by
    the later pieces' backwards (counted from its forward: an upper bound)."""
    pieces = piece_lengths(m, lay, seq)
    kv_token = PARAM_BYTES[lay.precision] * 2 * m.num_query_groups * m.head_dim / lay.tp   # one token's K and V
    units, heads = [], []
    for i, tokens in enumerate(pieces):
        saved, held = layer_act_bytes(m, tokens, lay.micro_batch, lay.recompute, lay.precision, lay.tp)
        cache = 0 if len(pieces) == 1 else (int(lay.recompute == "full") + int(i < len(pieces) - 1)) * kv_token
        units.append((saved + tokens * lay.micro_batch * cache, held))
        heads.append(_head_act_bytes(m, tokens, lay.micro_batch, lay.precision, lay.tp))
    last = lay.pp * lay.vpp - 1
    return [[(n * saved + (head[0] if s == last else 0), n * held + (head[1] if s == last else 0))
             for (saved, held), head in zip(units, heads)] for s, n in enumerate(stage_layers(m, lay))]


_DELTA = {"F": (1, 0), "B": (-1, 1), "W": (0, -1), "BW": (-1, 0), "O": (-1, 0), "R": (1, 0), "OW": (0, -1),
          "RW": (0, 1)}     # what each action adds to a rank's activations, in (M_B, M_W) of its chunk


@functools.lru_cache(maxsize=4096)
def _peak_terms(plan: Plan) -> tuple:
    """Per rank: each action's chunk (chunk x K + piece under Seq1F1B), its (M_B, M_W) coefficients, and whether
    it is a BW that sends (which holds M_W for a moment), as arrays: the part of `plan_peaks` that depends on the
    plan alone, built once."""
    rows, k = [], plan.seq_splits
    for rank, actions in enumerate(plan.actions):
        chunks = np.array([a.chunk * k + a.microbatch % k for a in actions], dtype=np.int64)
        coef = np.array([_DELTA[a.kind] for a in actions], dtype=np.float64).reshape(-1, 2)
        sends = np.array([a.kind == "BW" and plan.stage_of(rank, a.chunk) > 0
                          and plan.rank_chunk_of(plan.stage_of(rank, a.chunk) - 1)[0] != rank for a in actions],
                         dtype=bool)
        rows.append((chunks, coef, sends))
    return tuple(rows)


def plan_peaks(plan: Plan, chunk_bytes: list[list[tuple[float, float]]]) -> list[float]:
    """Peak activation bytes of each rank over `plan`: F adds the chunk's M_B, B keeps its M_W instead, W frees
    M_W, BW frees M_B (`chunk_bytes[rank][chunk]`: (M_B, M_W); under Seq1F1B with K pieces entry chunk x K + i
    is piece i's). A BW that sends to another rank runs as B, send,
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
    per_stage = chunk_act_bytes(m, lay, seq)
    if lay.pp == 1:         # one rank runs each microbatch's pieces forward, then backward: all of them at once
        return [sum(saved for saved, _ in per_stage[0])]
    plan = layout_plan(lay, min(m_micro, 4 * lay.pp))
    ranks = stage_ranks(lay)
    # a rank's chunks in stage order: interleaved r, r + p, ...; V placement r, 2p - 1 - r; each chunk's pieces
    chunk_bytes = [[unit for s in range(len(ranks)) if ranks[s] == r for unit in per_stage[s]] for r in range(lay.pp)]
    return plan_peaks(plan, chunk_bytes)


def rank_memory(m: LlamaConfig, lay: Layout, seq: int, global_batch: int) -> list[RankMemory]:
    """What each pipeline rank holds at its activation peak (peak_units: in whole microbatches of the largest
    chunk, its pieces summed under Seq1F1B)."""
    micro = global_batch // (lay.micro_batch * lay.dp)
    largest = max(sum(saved for saved, _ in units) for units in chunk_act_bytes(m, lay, seq))
    opt_bytes = OPTIMIZER_BYTES[lay.precision] / (lay.dp * lay.cp if lay.dist_opt else 1)   # ZeRO-1 over dp x cp
    comm = rank_comm_bytes(m, lay, seq, stage_ranks(lay), stage_layers(m, lay), PARAM_BYTES[lay.precision])
    return [RankMemory(PARAM_BYTES[lay.precision] * p, GRAD_BYTES * p, opt_bytes * p, act, act / largest, c)
            for p, act, c in zip(rank_params(m, lay), activation_peaks(m, lay, seq, micro), comm)]
