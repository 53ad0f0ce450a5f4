"""The qwen3 family's config and presets: LLaMA's fields (the head dim is `kv_channels`, which Qwen3 sets apart
from hidden / heads). `qwen3-0.6b` is the published Qwen3-0.6B shape (its config.json: head_dim 128 with 16
heads of a 1024-wide model, tied embeddings, rope_theta 1e6, RMSNorm eps 1e-6)."""
from __future__ import annotations

from dataclasses import dataclass

from llamapipe.model.llama import LlamaConfig


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    family: str = "qwen3"


PRESETS: dict[str, dict] = {
    "qwen3-tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                       num_query_groups=2, kv_channels=32, vocab_size=512, max_position_embeddings=256,
                       rope_theta=1e6, norm_epsilon=1e-6),
    "qwen3-0.6b": dict(num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                       num_query_groups=8, kv_channels=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1e6, norm_epsilon=1e-6, tie_word_embeddings=True),
}
