"""Qwen3 (arXiv 2505.09388): LLaMA's dense decoder with an RMSNorm over each head of the queries and the keys
before RoPE (q_norm, k_norm), and no q/k/v biases (Qwen2's are gone).

So the family's chunk is LLaMA's with `qk_norm` in its spec (model/layers.py `Attention`): two (head_dim,)
weights per layer, logical names `layers.<i>.attention.{q,k}_norm.weight`, replicated over TP and summed over
it at the step's end because each rank normalises only its own heads. The head dim may differ from hidden /
heads (Qwen3-0.6B: 128 against 1024 / 16), which the config's `kv_channels` carries.
"""
from __future__ import annotations

from llamapipe.model.llama import LlamaConfig, LlamaModel, counts
from llamapipe.model.spec import ModelSpec


class Qwen3Model(LlamaModel):
    """A Qwen3 chunk: LLaMA's, with per-head q and k norms."""

    spec = ModelSpec(qk_norm=True)


def model_parameters(m: LlamaConfig, tp: int = 1) -> int:
    """LLaMA's count plus the q and k norm weights of every layer."""
    return counts.model_parameters(m, tp) + m.num_layers * 2 * m.head_dim


flops_per_token = counts.flops_per_token   # a norm adds no matmul: Megatron's accounting is LLaMA's
