"""Parameter counts and training FLOPs per token of a LLaMA config: the one formula for each.

The log line's TFLOP/s and MFU (training/log.py), the planner's memory and step time
(tools/parallel_estimate.py) and the start-up memory check (training/arguments/memory.py) all import these,
so they agree. They honour what the built model holds: the head dim of --kv-channels (q and o are
heads x head_dim wide, not hidden wide), grouped-query k and v, SwiGLU's three MLP matrices, and the
vocabulary padded to a multiple of make_vocab_size_divisible_by x tp (the rows the embedding and the
output layer really have, Megatron's padded_vocab_size).

FLOPs follow Megatron-LM's accounting (megatron/training/training.py, num_floating_point_operations):
6 per matmul weight and token (forward 2, backward 4), plus the attention scores and their product with
the values, 4 x seq x (heads x head_dim) per token and layer forward, computed whole (no causal halving),
also x 3 for training. Full activation recompute runs the forward once more: 8 instead of 6. Norms and the
embedding lookup are not matmuls and add no FLOPs here.
"""
from __future__ import annotations

from llamapipe.model.llama.config import LlamaConfig


def layer_matmul_parameters(m: LlamaConfig) -> int:
    """Weights of one decoder layer's matmuls: q and o (h x heads*head_dim), k and v (h x groups*head_dim),
    and SwiGLU's gate, up and down (h x ffn)."""
    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    return 2 * h * q + 2 * h * kv + 3 * h * m.ffn_hidden_size


def layer_parameters(m: LlamaConfig) -> int:
    """Parameters of one decoder layer: its matmuls and its two RMSNorm scales."""
    return layer_matmul_parameters(m) + 2 * m.hidden_size


def model_parameters(m: LlamaConfig, tp: int = 1) -> int:
    """Parameters of the whole model: the embedding, the decoder layers, the final norm and, when not tied,
    the output layer, with the vocabulary padded for tensor-parallel size `tp` (as the built model holds)."""
    vocab = m.padded_vocab_size(tp) * m.hidden_size
    return m.num_layers * layer_parameters(m) + m.hidden_size + vocab * (1 if m.tie_word_embeddings else 2)


def flops_per_token(m: LlamaConfig, seq_length: int, tp: int = 1, full_recompute: bool = False) -> float:
    """Training FLOPs (forward and backward) per token of the whole model at `seq_length`."""
    passes = 4 if full_recompute else 3                 # forward, backward (2x), and the recomputed forward
    dense = m.num_layers * layer_matmul_parameters(m) + m.padded_vocab_size(tp) * m.hidden_size   # + output layer
    attention = m.num_layers * 4 * seq_length * m.num_attention_heads * m.head_dim   # QK^T and AV, forward
    return float(passes * (2 * dense + attention))
