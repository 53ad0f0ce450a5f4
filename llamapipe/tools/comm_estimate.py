"""The communication buffers of each pipeline rank of a layout, for `llamapipe plan`.

The buffers are counted by core/comm_memory.py, the model `llamapipe dry-run` counts them with; this module only
supplies, from the model's shape and the layout, what the dry run measures on the real shards: the pipeline peers
of each rank and their message (the hidden states of one microbatch, or of its largest Seq1F1B piece,
sequence-split over tp under sequence parallelism, which the planned command turns on), the parameters of each
rank in the model's order (the embedding, each layer's norm, q, k, v, o, norm, gate, up, down, then the final
norm and the output layer), and ZeRO-1's padded flat shard. The job's commands keep the default bucket size and
no --overlap-grad-reduce.
"""
from __future__ import annotations

import functools
from llamapipe.core.comm_memory import a2a_buffer_bytes, grad_bucket_bytes, p2p_receive_bytes, zero1_gather_bytes
from llamapipe.core.config import ParallelConfig
from llamapipe.core.optimizer.distrib_optimizer import ShardLayout
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools.parallel_layout import Layout, piece_lengths


def _layer_numels(m: LlamaConfig, tp: int) -> tuple[int, ...]:
    """One decoder layer's parameters on one tp rank, in the model's order (the norms whole on every rank)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    return h, q * h // tp, kv * h // tp, kv * h // tp, h * q // tp, h, f * h // tp, f * h // tp, h * f // tp


def rank_numels(m: LlamaConfig, tp: int, chunks: tuple[tuple[int, bool, bool], ...]) -> list[int]:
    """Parameters of one pipeline rank on one tp rank in the model's order; `chunks`: (layers, first, last) of
    each of its model chunks."""
    h, vocab = m.hidden_size, m.padded_vocab_size(tp) * m.hidden_size // tp
    numels: list[int] = []
    for layers, first, last in chunks:
        numels += [vocab] if first else []
        numels += list(_layer_numels(m, tp)) * layers
        numels += [h, vocab] if last else []
    return numels


@functools.lru_cache(maxsize=None)
def _params_and_buckets(m: LlamaConfig, tp: int, chunks: tuple[tuple[int, bool, bool], ...]) -> tuple[int, int]:
    """(parameters, `grad_bucket_bytes`) of one rank: `plan` asks for the same chunks in many layouts."""
    numels = rank_numels(m, tp, chunks)
    return sum(numels), grad_bucket_bytes(numels, ParallelConfig.ddp_bucket_size, ParallelConfig.overlap_grad_reduce)


def rank_comm_bytes(m: LlamaConfig, lay: Layout, seq: int, stage_ranks: list[int], stage_layers: list[int],
                    param_bytes: int) -> list[int]:
    """Communication buffers of each pipeline rank of `lay` under `comm_memory`'s model; `stage_ranks`,
    `stage_layers`: the rank and decoder layers of each virtual stage."""
    # the hidden states of a microbatch (its largest Seq1F1B piece), sequence parallel
    message = max(piece_lengths(m, lay, seq)) // lay.tp * lay.micro_batch * m.hidden_size * param_bytes
    a2a = (a2a_buffer_bytes(seq // lay.cp * lay.micro_batch, m.num_attention_heads // lay.tp,
                            m.num_query_groups // lay.tp, m.head_dim, param_bytes)
           if lay.cp > 1 and lay.cp_comm in ("a2a", "a2a+p2p") else 0)
    last = len(stage_ranks) - 1
    out = []
    for rank in range(lay.pp):
        stages = [s for s, r in enumerate(stage_ranks) if r == rank]
        peers = {stage_ranks[t] for s in stages for t in (s - 1, s + 1) if 0 <= t <= last} - {rank}
        chunks = tuple((stage_layers[s], s == 0, s == last) for s in stages)
        numel, buckets = _params_and_buckets(m, lay.tp, chunks)
        zero1 = (zero1_gather_bytes(ShardLayout((numel,), lay.dp * lay.cp).padded_total, param_bytes)
                 if lay.dist_opt and lay.dp * lay.cp > 1 else 0)
        out.append(p2p_receive_bytes([message] * len(peers)) + buckets + zero1 + a2a)
    return out
