"""Qwen2 (arXiv 2407.10671): LLaMA's dense decoder with biases on the q, k and v projections.

That is the one architectural difference (Megatron-LM trains it as LLaMA plus `--add-qkv-bias`); the o
projection and the MLP have none, and the rest (RMSNorm, RoPE, GQA, SwiGLU, untied or tied embeddings) is
LLaMA's. So the family's chunk is LLaMA's with `qkv_bias` in its spec: the column-parallel biases are split
over TP like the output rows and get their gradient in B (core/tensor_parallel/layers.py). Logical names add
`layers.<i>.attention.{q,k,v}_proj.bias`.
"""
from __future__ import annotations

from llamapipe.model.llama import LlamaConfig, LlamaModel, counts
from llamapipe.model.spec import ModelSpec


class Qwen2Model(LlamaModel):
    """A Qwen2 chunk: LLaMA's, with biases on q, k and v."""

    spec = ModelSpec(qkv_bias=True)


def model_parameters(m: LlamaConfig, tp: int = 1) -> int:
    """LLaMA's count plus the q, k and v biases of every layer."""
    biases = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    return counts.model_parameters(m, tp) + m.num_layers * biases


flops_per_token = counts.flops_per_token   # a bias adds no matmul: Megatron's accounting is LLaMA's
