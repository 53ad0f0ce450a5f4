"""Qwen2 (arXiv 2407.10671): LLaMA's dense decoder with biases on the q, k and v projections.

That is the one architectural difference (Megatron-LM trains it as LLaMA plus `--add-qkv-bias`); the o
projection and the MLP have none, and the rest (RMSNorm, RoPE, GQA, SwiGLU, untied or tied embeddings) is
LLaMA's. So the family is LLaMA's chunk with a different attention class: `Qwen2Attention` sets
`qkv_bias`, whose column-parallel biases are split over TP like the output rows and get their gradient in B
(core/tensor_parallel/layers.py). Logical names add `layers.<i>.attention.{q,k,v}_proj.bias`. The presets
carry Qwen2's rope_theta 1e6 and RMSNorm eps 1e-6; the field defaults stay LLaMA's (Megatron's defaults for a
run given shape flags and --add-qkv-bias). The HF adapter is model/qwen2_hf.py; the registry entry
model/families.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from llamapipe.model import counts
from llamapipe.model.config import LlamaConfig
from llamapipe.model.layers import Attention, DecoderLayer
from llamapipe.model.llama import LlamaModel


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    family: str = "qwen2"


PRESETS: dict[str, dict] = {
    "qwen2-tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                       num_query_groups=2, vocab_size=512, max_position_embeddings=256, rope_theta=1e6,
                       norm_epsilon=1e-6),
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                         norm_epsilon=1e-6, tie_word_embeddings=True),
}


class Qwen2Attention(Attention):
    qkv_bias = True


class Qwen2DecoderLayer(DecoderLayer):
    attention_class = Qwen2Attention


class Qwen2Model(LlamaModel):
    """A Qwen2 chunk: LLaMA's, with Qwen2's decoder layers."""

    layer_class = Qwen2DecoderLayer


def model_parameters(m: LlamaConfig, tp: int = 1) -> int:
    """LLaMA's count plus the q, k and v biases of every layer."""
    biases = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    return counts.model_parameters(m, tp) + m.num_layers * biases


flops_per_token = counts.flops_per_token   # a bias adds no matmul: Megatron's accounting is LLaMA's
