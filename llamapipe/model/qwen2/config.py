"""The qwen2 family's config and presets: LLaMA's fields; the presets carry Qwen2's rope_theta 1e6 and RMSNorm
eps 1e-6, while the field defaults stay LLaMA's (Megatron's defaults for a run given shape flags and
--add-qkv-bias)."""
from __future__ import annotations

from dataclasses import dataclass

from llamapipe.model.llama import LlamaConfig


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
